"""FSDP2's precision: the run's autocast/scaling plus the ``MixedPrecisionPolicy`` handed to ``fully_shard``."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from hasten.base.dataclasses import AutocastKwargs
from hasten.config.plugins.fsdp import policy_dtype, policy_from_fields
from hasten.precision.base import Precision


class FSDPPrecision(Precision):
    """The run's precision (fp32, bf16 or fp16 autocast) with FSDP2's parameter/reduction dtypes on top.

    Everything the ordinary precision does (autocast forward, loss scaling, the optimizer step) is
    delegated to it; :meth:`mp_policy` adds the sharding engine's part.

    Args:
        inner: the precision built for ``mixed_precision``.
        policy: the plugin's ``mixed_precision_policy`` (a ``MixedPrecisionPolicy``, a dict of its
            fields, a dtype name) or None to derive it from ``mixed_precision``.
    """

    def __init__(self, inner: Precision, policy: Any = None) -> None:
        super().__init__(inner.device_type, inner.autocast_handler)
        self.inner = inner
        self.policy = policy

    @property
    def mixed_precision(self) -> str:  # type: ignore[override]
        return self.inner.mixed_precision

    @property
    def scaler(self) -> Any:
        return self.inner.scaler

    @property
    def native_amp(self) -> bool:
        return self.inner.native_amp

    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> AbstractContextManager[Any]:
        return self.inner.autocast(autocast_handler)

    def convert_module(self, model: nn.Module) -> None:
        self.inner.convert_module(model)

    def wrap_forward(self, model: nn.Module) -> None:
        self.inner.wrap_forward(model)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self.inner.backward(loss, **kwargs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self.inner.unscale_(optimizer)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.inner.setup_optimizer(optimizer)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any = None) -> bool:
        return self.inner.optimizer_step(optimizer, closure)

    def state_dict(self) -> dict[str, Any] | None:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def mp_policy(self) -> Any:
        """FSDP's ``MixedPrecisionPolicy``: the plugin's, else one derived from ``mixed_precision``.

        bf16/fp16 gather parameters and compute in half precision while gradients are reduced in
        fp32 and the optimizer keeps fp32 shards (the accurate choice; FSDP's default reduces in the
        parameter dtype).

        Raises:
            ConfigurationError: unknown policy fields or dtype names.
        """
        from torch.distributed.fsdp import MixedPrecisionPolicy

        value = self.policy
        if value is None and self.mixed_precision in ("bf16", "fp16"):
            value = self.mixed_precision
        if value is None or isinstance(value, MixedPrecisionPolicy):
            return value or MixedPrecisionPolicy()
        if isinstance(value, dict):
            return policy_from_fields(value)
        dtype = policy_dtype(value)
        if dtype == torch.float32:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


__all__ = ["FSDPPrecision"]
