"""Accelerate's ``accelerate.inference`` module path.

Pipeline-parallel inference through PiPPy (``prepare_pippy``, ``build_pipeline``, ``pippy_forward``) is
refused with a ``ConfigurationError`` naming hasten's alternatives: ``split_between_processes`` for
data-parallel inference, and ``dispatch_model`` / ``load_checkpoint_and_dispatch`` for one model
spread over devices. ``generate_device_map`` and ``find_pippy_batch_size`` work.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from hasten.big_modeling import calculate_maximum_sizes, infer_auto_device_map
from hasten.ops.tree import find_batch_size
from hasten.utils.refusals import PIPPY, refused_function

__all__ = ["build_pipeline", "find_pippy_batch_size", "generate_device_map", "pippy_forward", "prepare_pippy"]


def generate_device_map(model: nn.Module, num_processes: int = 1, no_split_module_classes: list[str] | None = None,
                        max_memory: dict[Any, int | str] | None = None) -> dict[str, Any]:
    """Split ``model`` into ``num_processes`` consecutive, roughly equal parts: a device map onto 0..n-1.

    Example:
        >>> generate_device_map(nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]), num_processes=2)
        {'0': 0, '1': 0, '2': 1, '3': 1}
    """
    if num_processes < 1:
        raise ValueError(f"generate_device_map: num_processes={num_processes} must be at least 1")
    if max_memory is None:
        # Each device's budget is its share of the model plus room for the largest layer, which the
        # placement keeps free on every device, with 10% slack for shared tensors.
        total, (largest, _) = calculate_maximum_sizes(model)
        share = math.ceil((total / num_processes + largest) * 1.1)
        max_memory = {index: share for index in range(num_processes)}
    return infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split_module_classes,
                                 clean_result=False)


def find_pippy_batch_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The batch size of the first tensor found in ``args``, then ``kwargs`` (``None`` without one)."""
    for value in (*args, *kwargs.values()):
        size = find_batch_size(value) if value is not None else None
        if size is not None:
            return size
    return None


prepare_pippy = refused_function("prepare_pippy", "model split_points no_split_module_classes example_args "
                                 "example_kwargs num_chunks gather_output", PIPPY)
build_pipeline = refused_function("build_pipeline", "model split_points args kwargs num_chunks", PIPPY)
pippy_forward = refused_function("pippy_forward", "forward num_chunks gather_output args kwargs", PIPPY)
