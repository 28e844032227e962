"""Local SGD: each process takes ``local_sgd_steps`` optimizer steps on its own, then the processes
average their parameters. Less communication than DDP's per-step all-reduce.

Example:
    >>> with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=8) as local_sgd:
    ...     for batch in loader:
    ...         with accelerator.accumulate(model):
    ...             accelerator.backward(loss_fn(model(batch)))
    ...             optimizer.step(); optimizer.zero_grad()
    ...             local_sgd.step()
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from hasten._lazy import accelerate_path_getattr
from hasten.base.dataclasses import DistributedType

_SUPPORTED = {DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU}


class LocalSGD:
    """Average model parameters across processes every ``local_sgd_steps`` calls of :meth:`step`.

    Inside the ``with`` block DDP's per-step gradient synchronisation is off; leaving the block
    averages once more so every process ends with the same model.

    Args:
        accelerator: the Accelerator.
        model: the prepared model.
        local_sgd_steps: optimizer steps between two averagings.
        enabled: turn it off without changing the loop.

    Raises:
        NotImplementedError: under FSDP2 or DeepSpeed (parameters are sharded there).
        ValueError: ``local_sgd_steps`` below 1.
    """

    def __init__(self, accelerator: Any, model: torch.nn.Module, local_sgd_steps: int, enabled: bool = True) -> None:
        if accelerator.distributed_type not in _SUPPORTED:
            raise NotImplementedError(f"LocalSGD works with replicated models only (CPU or GPU DDP), not with "
                                      f"{accelerator.distributed_type}.")
        if local_sgd_steps < 1:
            raise ValueError(f"LocalSGD(local_sgd_steps={local_sgd_steps}) must be at least 1")
        self.enabled = enabled and accelerator.use_distributed
        self.num_steps = 0
        self.accelerator = accelerator
        self.model = model
        self.local_sgd_steps = local_sgd_steps
        self._no_sync: Any = None

    def __enter__(self) -> LocalSGD:
        if self.enabled:
            self._no_sync = self.accelerator.no_sync(self.model)
            self._no_sync.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self.enabled:
            if exc_type is None:
                self._average_parameters()
            self._no_sync.__exit__(exc_type, exc, tb)

    def step(self) -> None:
        """Count an optimizer step; every ``local_sgd_steps``-th one averages the parameters."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._average_parameters()

    @torch.no_grad()
    def _average_parameters(self) -> None:
        # One flattened all-reduce instead of one per parameter.
        params = [p for p in self.model.parameters()]
        flat = parameters_to_vector(params)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat /= dist.get_world_size()
        vector_to_parameters(flat, params)

# Names Accelerate's module at this path shows but defines elsewhere (hasten/_accelerate_shown.py).
__getattr__ = accelerate_path_getattr(__name__, globals())
