"""Mixed precision with torch autocast: bf16, and fp16 with a GradScaler (also on the CPU)."""

from __future__ import annotations

import functools
import weakref
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch
from torch import nn

from hasten.base.dataclasses import AutocastKwargs, GradScalerKwargs
from hasten.exceptions import ConfigurationError
from hasten.precision.base import Precision, attach_autocast_forward


class _AutocastPrecision(Precision):
    dtype: ClassVar[torch.dtype]

    @property
    def native_amp(self) -> bool:
        return True

    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> AbstractContextManager[Any]:
        handler = autocast_handler or self.autocast_handler
        kwargs = handler.to_kwargs() if handler is not None else {}
        return torch.autocast(device_type=self.device_type, dtype=self.dtype, **kwargs)

    def wrap_forward(self, model: nn.Module) -> None:
        attach_autocast_forward(model, self)


class BF16Precision(_AutocastPrecision):
    """bf16 autocast; no loss scaling is needed (bf16 has fp32's exponent range)."""

    mixed_precision = "bf16"
    dtype = torch.bfloat16


class FP16Precision(_AutocastPrecision):
    """fp16 autocast with dynamic loss scaling (``torch.amp.GradScaler``), on GPUs and on the CPU.

    Accelerate silently trains in fp32 on the CPU while reporting fp16; hasten really runs fp16
    autocast with a CPU GradScaler, or refuses when the installed torch cannot.
    """

    mixed_precision = "fp16"
    dtype = torch.float16

    def __init__(self, device_type: str = "cpu", autocast_handler: AutocastKwargs | None = None,
                 scaler_handler: GradScalerKwargs | None = None) -> None:
        super().__init__(device_type, autocast_handler)
        kwargs = scaler_handler.to_kwargs() if scaler_handler is not None else {}
        try:
            self.scaler = torch.amp.GradScaler(device_type, **kwargs)
        except (RuntimeError, TypeError, AttributeError) as exc:
            raise ConfigurationError(
                f"mixed_precision='fp16' on device type {device_type!r} needs torch.amp.GradScaler({device_type!r}), "
                f"which this torch ({torch.__version__}) does not provide: {exc}. HINT: use mixed_precision='bf16' "
                "or 'no' here.") from exc
        # optimizer -> [ran]: set by a flag on the optimizer's own step, which GradScaler.step calls only
        # when the gradients are finite; this tells a skipped step without a device sync.
        self._stepped: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[bool]] = weakref.WeakKeyDictionary()

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self.scaler.scale(loss).backward(**kwargs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.unscale_(optimizer)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Install the step flag once (not per step) on ``optimizer.step``."""
        if optimizer in self._stepped:
            return
        flag = [False]
        inner = optimizer.step

        @functools.wraps(inner)  # keeps the LR scheduler's marker, so torch does not warn on every step
        def flagged_step(*args: Any, **kwargs: Any) -> Any:
            flag[0] = True
            return inner(*args, **kwargs)

        optimizer.step = flagged_step  # type: ignore[method-assign]
        self._stepped[optimizer] = flag

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any = None) -> bool:
        """``scaler.step`` then ``scaler.update``; False when the gradients overflowed and the step was skipped."""
        self.setup_optimizer(optimizer)
        flag = self._stepped[optimizer]
        flag[0] = False
        if closure is None:
            self.scaler.step(optimizer)
        else:
            self.scaler.step(optimizer, closure)
        self.scaler.update()
        return flag[0]

    def state_dict(self) -> dict[str, Any] | None:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scaler.load_state_dict(state)
