"""Accelerator members for features hasten runs in their trivial form (no pipeline or sequence parallelism,
no LOMO). The mesh members (ranks, ``torch_device_mesh``, context parallel) have one home:
``accelerator/_parallelism.py``."""

from __future__ import annotations

from typing import Any

from torch import nn

from hasten.accelerator._base import AcceleratorBase
from hasten.base.dataclasses import DistributedType
from hasten.base.refusals import LOMO, refusal

_MULTI_DEVICE = {DistributedType.MULTI_GPU, DistributedType.MULTI_NPU, DistributedType.MULTI_MLU,
                 DistributedType.MULTI_SDAA, DistributedType.MULTI_MUSA, DistributedType.MULTI_XPU,
                 DistributedType.MULTI_HPU, DistributedType.MULTI_NEURON}


class TrivialFeaturesMixin(AcceleratorBase):
    """Accelerate's members for features hasten has no engine for, each in its honest trivial form."""

    @property
    def multi_device(self) -> bool:
        """True when several accelerator devices (GPUs) take part, replicated by DDP."""
        return self.state.distributed_type in _MULTI_DEVICE

    @property
    def pipeline_parallel_rank(self) -> int:
        return 0

    @property
    def should_save_model(self) -> bool:
        """Whether this process takes part in saving the model (every process does; the strategy decides who writes)."""
        return True

    @property
    def use_stateful_dataloader(self) -> bool:
        """Accelerate's torchdata switch (hasten's loaders resume without it; always False)."""
        return bool(getattr(self.dataloader_config, "use_stateful_dataloader", False))

    @property
    def fp8_backend(self) -> Any:
        """The fp8 engine in use: ``FP8BackendType.AO`` under fp8, else ``NO``."""
        from hasten.base.fp8 import FP8BackendType

        return FP8BackendType.AO if self.state.mixed_precision == "fp8" else FP8BackendType.NO

    def deepspeed_ulysses_dl_adapter(self, dl: Any, model: nn.Module) -> Any:
        """Adapt a loader for DeepSpeed-Ulysses sequence parallelism; without it (hasten), the loader itself."""
        return dl

    def lomo_backward(self, loss: Any, learning_rate: float) -> None:
        """LOMO's fused backward-and-step; refused (hasten has no LOMO engine)."""
        raise refusal("Accelerator.lomo_backward", LOMO)
