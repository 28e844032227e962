"""How the model is replicated or sharded: the strategy interface and the single-device strategy."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hasten.precision import Precision
from hasten.utils.dataclasses import DistributedType


class Strategy:
    """Replication/sharding behaviour behind the ``Accelerator`` facade.

    Args:
        device: the torch device of this process.
        precision: the precision plugin.
        distributed_type: Accelerate's reporting value for this run.
        num_processes: processes in the run.
    """

    #: True when ``Accelerator.backward`` divides the loss by the accumulation steps before backward
    #: (DeepSpeed scales by itself).
    divides_loss_for_accumulation = True
    #: True when model and optimizer must be prepared together (FSDP2, DeepSpeed).
    needs_model_and_optimizer_together = False
    #: True when save_state/load_state must hand models and optimizers to this strategy (sharded formats).
    saves_models_itself = False
    #: True when the engine applies the optimizer step (and zero_grad) itself inside backward (DeepSpeed).
    engine_steps_optimizer = False
    #: Accelerate's ``accelerator.is_fsdp2``.
    is_fsdp2 = False

    def __init__(self, device: torch.device, precision: Precision, distributed_type: DistributedType,
                 num_processes: int = 1) -> None:
        self.device = device
        self.precision = precision
        self.distributed_type = distributed_type
        self.num_processes = num_processes

    def release(self) -> None:
        """Drop what ties prepared models to the process group, before the group is destroyed.

        Called by ``end_training`` and at interpreter exit. Default: nothing to release.
        """

    def apply_precision(self, model: nn.Module) -> None:
        """Give the model's forward this run's mixed precision (autocast + fp32 outputs by default)."""
        if self.precision.native_amp:
            self.precision.wrap_forward(model)

    def observe_prepare_call(self, objects: Sequence[Any], *, split_batches: bool = False) -> None:
        """See every object of a ``prepare`` call before its model is prepared (default: nothing).

        DeepSpeed reads the data loaders' batch sizes and the schedulers here to fill its "auto" config.
        """

    def prepare_model_and_optimizers(self, model: nn.Module, optimizers: list[torch.optim.Optimizer], *,
                                     device_placement: bool = True, accumulation_steps: int | None = None,
                                     ) -> tuple[nn.Module, list[torch.optim.Optimizer]]:
        """Strategies that shard parameters wrap the model and re-point the optimizers at the new parameters.

        Returns the wrapped model and the (raw) optimizers to use; the facade wraps those for
        accumulation. Only called when ``needs_model_and_optimizer_together``.
        """
        if device_placement:
            model = model.to(self.device)
        self.apply_precision(model)
        return self.wrap_model(model), optimizers

    def save_models_and_optimizers(self, models: list[nn.Module], optimizers: list[torch.optim.Optimizer],
                                   folder: Path) -> None:
        """Write model and optimizer state into ``folder`` (every process calls it; sharded strategies only)."""
        raise NotImplementedError(f"{type(self).__name__} saves models through the common files")

    def check_models_and_optimizers(self, models: list[nn.Module], optimizers: list[torch.optim.Optimizer],
                                    folder: Path) -> None:
        """Raise before anything is loaded if ``folder`` cannot be loaded into these models/optimizers."""
        raise NotImplementedError(f"{type(self).__name__} loads models through the common files")

    def load_models_and_optimizers(self, models: list[nn.Module], optimizers: list[torch.optim.Optimizer],
                                   folder: Path) -> None:
        """Read what :meth:`save_models_and_optimizers` wrote (every process calls it)."""
        raise NotImplementedError(f"{type(self).__name__} loads models through the common files")

    def wrap_model(self, model: nn.Module, *, evaluation_mode: bool = False) -> nn.Module:
        """Wrap an already placed model for this strategy (the single-device strategy keeps it)."""
        return model

    def is_wrapped(self, model: nn.Module) -> bool:
        """True when ``model`` is already this strategy's wrapper."""
        return False

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside any wrapper of this strategy (and torch.compile)."""
        return unwrap_common(model)

    def model_state_dict(self, model: nn.Module, *, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The full state dict of ``model`` (called on every process; sharded strategies gather)."""
        return (self.unwrap(model) if unwrap else model).state_dict()

    def accumulation_steps(self, requested: int) -> int:
        """Micro-steps per optimizer step this strategy uses, given the Accelerator's ``requested`` count.

        Called by the facade after ``prepare``; an engine with its own configured count (DeepSpeed)
        returns that one, and the facade adopts it.
        """
        return requested

    def backward(self, loss: torch.Tensor, *, sync: bool = True, **kwargs: Any) -> None:
        """Backward pass through the precision plugin (loss already divided for accumulation).

        Args:
            loss: the loss.
            sync: True on a synchronising micro-step (the facade's ``sync_gradients``).
        """
        self.precision.backward(loss, **kwargs)

    def no_sync(self, model: nn.Module) -> Any:
        """Context in which backward passes do not synchronise gradients."""
        return nullcontext()

    @contextmanager
    def trigger_sync_in_backward(self, model: nn.Module) -> Iterator[None]:
        """Force a gradient sync in the next backward even inside ``no_sync``."""
        yield

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients (already unscaled) by total norm; returns the norm before clipping."""
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        """Clip gradients (already unscaled) element-wise."""
        torch.nn.utils.clip_grad_value_(parameters, clip_value)


class SingleDeviceStrategy(Strategy):
    """One process: nothing to replicate."""


def unwrap_common(model: nn.Module) -> nn.Module:
    """Strip torch.compile's and DDP-like ``.module`` wrappers."""
    while True:
        if hasattr(model, "_orig_mod") and isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            model = model._orig_mod
        elif isinstance(model, nn.parallel.DistributedDataParallel) or type(model).__name__ == "DeepSpeedEngine":
            model = model.module
        else:
            return model
