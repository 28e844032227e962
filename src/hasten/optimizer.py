"""Accelerate's ``accelerate.optimizer`` module path (the class lives in :mod:`hasten.optim`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hasten._lazy import accelerate_path_getattr
from hasten.ops.tree import send_to_device
from hasten.optim import AcceleratedOptimizer

__all__ = ["AcceleratedOptimizer", "move_to_device", "patch_optimizer_step"]


def move_to_device(state: Any, device: torch.device | str) -> Any:
    """Move every tensor of an optimizer state (nested dicts, lists) to ``device``."""
    return send_to_device(state, device)


def patch_optimizer_step(accelerated_optimizer: AcceleratedOptimizer, method: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a bound ``step`` so that calling it marks the optimizer as stepped (the grad scaler may skip the
    real step; the mark tells the scheduler whether a step happened)."""

    def patched_step(*args: Any, **kwargs: Any) -> Any:
        accelerated_optimizer._accelerate_step_called = True  # type: ignore[attr-defined]
        return method(*args, **kwargs)

    return patched_step

# Names Accelerate's module at this path shows but defines elsewhere (hasten/_accelerate_shown.py).
__getattr__ = accelerate_path_getattr(__name__, globals())
