"""What numbers: the precision plugin interface and full precision (fp32)."""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager, nullcontext
from typing import Any, ClassVar

import torch
from torch import nn

from hasten.base.dataclasses import AutocastKwargs
from hasten.ops.tree import convert_to_fp32


class Precision:
    """Full precision: every hook is a no-op. Subclasses add autocast and loss scaling.

    Attributes:
        mixed_precision: Accelerate's name for the mode ("no", "fp16", "bf16").
        scaler: the GradScaler, or None when gradients are not scaled.
    """

    mixed_precision: ClassVar[str] = "no"
    scaler: Any = None

    def __init__(self, device_type: str = "cpu", autocast_handler: AutocastKwargs | None = None) -> None:
        self.device_type = device_type
        self.autocast_handler = autocast_handler

    @property
    def native_amp(self) -> bool:
        """True when torch autocast is in use (Accelerate's attribute)."""
        return False

    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> AbstractContextManager[Any]:
        """The context that runs code in this precision (``accelerator.autocast()``)."""
        return nullcontext()

    def convert_module(self, model: nn.Module) -> None:  # noqa: B027 - optional hook
        """Change ``model``'s layers for this precision, in place, before it is wrapped (fp8 swaps linears)."""

    def wrap_forward(self, model: nn.Module) -> None:
        """Make ``model.forward`` run under :meth:`autocast` and return fp32 outputs."""

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backward pass, scaling the loss if this precision scales it."""
        loss.backward(**kwargs)

    def direct_backward(self) -> bool:
        """True when :meth:`backward` is plain ``loss.backward`` (this class's), so callers may skip it."""
        return type(self).backward is Precision.backward

    def direct_optimizer_step(self) -> bool:
        """True when :meth:`optimizer_step` is the optimizer's own step and never skips (no loss scaler)."""
        return type(self).optimizer_step is Precision.optimizer_step and self.scaler is None

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients of ``optimizer`` by the loss scale (once per step)."""

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Prepare ``optimizer`` for :meth:`optimizer_step` (called once, when it is prepared)."""

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any = None) -> bool:
        """Apply the update; returns False when it was skipped (a scaled step whose gradients overflowed)."""
        if closure is None:
            optimizer.step()
        else:
            optimizer.step(closure)
        return True

    def state_dict(self) -> dict[str, Any] | None:
        """The scaler state to checkpoint (None when there is none)."""
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""


class _ForwardWithAutocast:
    """Picklable replacement of ``model.forward``: autocast + fp32 outputs (kept for unwrap_model)."""

    def __init__(self, original: Any, precision: Precision) -> None:
        self.model_forward = original
        self.precision = precision
        functools.update_wrapper(self, original)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision.autocast():
            out = self.model_forward(*args, **kwargs)
        return convert_to_fp32(out)

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def attach_autocast_forward(model: nn.Module, precision: Precision) -> None:
    """Replace ``model.forward`` by the autocasting wrapper (idempotent)."""
    if isinstance(model.forward, _ForwardWithAutocast):
        return
    model._original_forward = model.forward  # type: ignore[assignment]
    model.forward = _ForwardWithAutocast(model.forward, precision)  # type: ignore[method-assign]


def detach_autocast_forward(model: nn.Module) -> nn.Module:
    """Restore the original ``forward`` replaced by :func:`attach_autocast_forward`."""
    forward = model.__dict__.get("forward")
    if isinstance(forward, _ForwardWithAutocast):
        original = forward.model_forward
        # A bound method of the model itself is what the class provides: drop the instance attribute.
        if getattr(original, "__self__", None) is model and getattr(original, "__func__", None) is type(model).forward:
            del model.forward
        else:
            model.forward = original  # type: ignore[method-assign]
        model.__dict__.pop("_original_forward", None)
    return model
