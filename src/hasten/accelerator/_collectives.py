"""Collectives on the Accelerator (thin wrappers over ``hasten.ops``). Every process must call them."""

from __future__ import annotations

from typing import Any

import torch

from hasten import ops
from hasten.accelerator._base import AcceleratorBase
from hasten.runtime.preemption import PREEMPTION as _PREEMPTION


class CollectivesMixin(AcceleratorBase):
    """gather / gather_for_metrics / reduce / pad_across_processes and the early-stop trigger."""

    def gather(self, tensor: Any) -> Any:
        """All-gather (nested) tensors and concatenate them on dim 0.

        Example:
            >>> predictions = accelerator.gather(logits.argmax(-1))
        """
        _PREEMPTION.before_call("gather")  # a preemption boundary in loops without steps
        return ops.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gather for evaluation, dropping the samples that were duplicated to fill the last batch.

        Every sample of the evaluation set then appears exactly once across the results.
        """
        from hasten.data.metrics import gather_for_metrics

        _PREEMPTION.before_call("gather_for_metrics")
        return gather_for_metrics(input_data, use_gather_object=use_gather_object, sources=self._metrics_sources())

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Reduce across processes; the default here is ``"sum"`` (``hasten.utils.reduce`` defaults to mean)."""
        _PREEMPTION.before_call("reduce")
        return ops.reduce(tensor, reduction=reduction, scale=scale)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        """Pad to the largest size along ``dim`` on any process, so ``gather`` works."""
        _PREEMPTION.before_call("pad_across_processes")
        return ops.pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)

    def set_trigger(self) -> None:
        """Raise this process's flag (e.g. for early stopping); see :meth:`check_trigger`."""
        self._trigger_flag = True

    def check_trigger(self) -> bool:
        """True on every process if any process called :meth:`set_trigger`; the flag is then cleared.

        Example:
            >>> if loss < 0.1: accelerator.set_trigger()
            >>> if accelerator.check_trigger(): break
        """
        _PREEMPTION.before_call("check_trigger")
        flag = torch.tensor([1.0 if getattr(self, "_trigger_flag", False) else 0.0], device=self.device)
        total = ops.reduce(flag, reduction="sum")
        if total.item() >= 1:
            self._trigger_flag = False
            return True
        return False
