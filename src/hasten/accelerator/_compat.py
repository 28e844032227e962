"""Accelerator members for features hasten runs in their trivial form (no sequence parallelism, no LOMO), and
the one-dimensional answers of the mesh members: with a ``ParallelismConfig``, ``accelerator/_parallelism.py``
(earlier in the Accelerator's bases) answers from the real mesh instead."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from hasten.accelerator._base import AcceleratorBase
from hasten.utils.dataclasses import DistributedType
from hasten.utils.refusals import LOMO, refusal

_MULTI_DEVICE = {DistributedType.MULTI_GPU, DistributedType.MULTI_NPU, DistributedType.MULTI_MLU,
                 DistributedType.MULTI_SDAA, DistributedType.MULTI_MUSA, DistributedType.MULTI_XPU,
                 DistributedType.MULTI_HPU, DistributedType.MULTI_NEURON}


class ParallelismMixin(AcceleratorBase):
    """Mesh ranks and parallelism switches (hasten: a one-dimensional data-parallel mesh)."""

    @property
    def multi_device(self) -> bool:
        """True when several accelerator devices (GPUs) take part, replicated by DDP."""
        return self.state.distributed_type in _MULTI_DEVICE

    @property
    def parallelism_config(self) -> Any:
        """The ``ParallelismConfig`` (None: hasten takes its one data-parallel dimension from the launch)."""
        return self.state.parallelism_config

    @property
    def torch_device_mesh(self) -> Any:
        """The ``DeviceMesh`` the Accelerator built (None when it built none)."""
        return self.state.device_mesh

    @property
    def is_composable_parallelism_enabled(self) -> bool:
        """Whether tensor/context/sequence parallelism is composed with data parallelism (never, in hasten)."""
        return False

    @property
    def data_parallel_rank(self) -> int:
        """This process's rank among the data-parallel replicas: its global rank."""
        return self.process_index

    @property
    def data_parallel_shard_rank(self) -> int:
        """This process's rank in the sharded dimension: its rank under FSDP2, 0 otherwise."""
        return self.process_index if self.state.distributed_type == DistributedType.FSDP else 0

    @property
    def tensor_parallel_rank(self) -> int:
        return 0

    @property
    def context_parallel_rank(self) -> int:
        return 0

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
        from hasten.utils.fp8 import FP8BackendType

        return FP8BackendType.AO if self.state.mixed_precision == "fp8" else FP8BackendType.NO

    @contextlib.contextmanager
    def maybe_context_parallel(self, buffers: list[Any] | None = None, buffer_seq_dims: list[int] | None = None,
                               no_restore_buffers: set[Any] | None = None) -> Iterator[None]:
        """Context parallelism for the block when enabled; hasten never enables it, so this does nothing."""
        yield

    def deepspeed_ulysses_dl_adapter(self, dl: Any, model: nn.Module) -> Any:
        """Adapt a loader for DeepSpeed-Ulysses sequence parallelism; without it (hasten), the loader itself."""
        return dl

    def lomo_backward(self, loss: Any, learning_rate: float) -> None:
        """LOMO's fused backward-and-step; refused (hasten has no LOMO engine)."""
        raise refusal("Accelerator.lomo_backward", LOMO)
