"""What the ``Accelerator``'s mixins use from the core and from each other, declared for the type checker.

Every mixin subclasses :class:`AcceleratorBase`, so ``mypy`` checks ``self._strategy.save(...)`` in
``_checkpoint.py`` against the real types. The declarations exist only while type checking: at run
time the class is empty and the attributes come from ``Accelerator.__init__`` and the other mixins.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from hasten.base.dataclasses import DataLoaderConfiguration, ProjectConfiguration
    from hasten.connector import Settings
    from hasten.precision import Precision
    from hasten.state import AcceleratorState, GradientState
    from hasten.strategies import Strategy


class AcceleratorBase:
    """The attributes and cross-mixin methods of the ``Accelerator`` (type declarations only)."""

    if TYPE_CHECKING:
        state: AcceleratorState
        gradient_state: GradientState
        _strategy: Strategy
        _precision: Precision
        _settings: Settings
        _models: list[nn.Module]
        _optimizers: list[Any]
        _schedulers: list[Any]
        _dataloaders: list[Any]
        _custom_objects: list[Any]
        _save_model_state_pre_hook: dict[Any, Any]
        _load_model_state_pre_hook: dict[Any, Any]
        project_configuration: ProjectConfiguration
        dataloader_config: DataLoaderConfiguration
        device_placement: bool
        rng_types: list[str]
        step_scheduler_with_optimizer: bool
        step: int
        trackers: list[Any]
        log_with: list[Any]

        @property
        def device(self) -> torch.device: ...
        @property
        def num_processes(self) -> int: ...
        @property
        def process_index(self) -> int: ...
        @property
        def local_process_index(self) -> int: ...
        @property
        def is_main_process(self) -> bool: ...
        @property
        def is_local_main_process(self) -> bool: ...
        @property
        def use_distributed(self) -> bool: ...
        @property
        def project_dir(self) -> str | None: ...
        @property
        def logging_dir(self) -> str | None: ...
        @property
        def split_batches(self) -> bool: ...
        @property
        def sync_gradients(self) -> bool: ...
        @property
        def gradient_accumulation_steps(self) -> int: ...
        @gradient_accumulation_steps.setter
        def gradient_accumulation_steps(self, value: int) -> None: ...

        def wait_for_everyone(self) -> None: ...
        def _data_parallel_position(self) -> tuple[int, int]: ...
        def _metrics_sources(self) -> list[int] | None: ...
        def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True,
                         keep_torch_compile: bool = True) -> nn.Module: ...
        def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> Any: ...


__all__ = ["AcceleratorBase"]
