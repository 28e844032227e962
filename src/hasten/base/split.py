"""Contiguous splitting of inputs between processes (``split_between_processes``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch


def share_bounds(length: int, num_processes: int, index: int) -> tuple[int, int]:
    """Start and end of process ``index``'s share: the first ``length % n`` shares are one longer."""
    base, extra = divmod(length, num_processes)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def _split_one(value: Any, num_processes: int, index: int, apply_padding: bool) -> Any:
    length = len(value)
    start, end = share_bounds(length, num_processes, index)
    if not isinstance(value, (list, tuple, torch.Tensor)):  # a datasets.Dataset: slicing would give a dict
        rows = list(range(start, end)) if start < length else [length - 1]
        if apply_padding:
            rows += [rows[-1]] * (-(-length // num_processes) - len(rows))
        return value.select(rows)
    target = -(-length // num_processes)  # the longest share
    part: Any
    if start >= length:
        part = value[-1:] if length else value[0:0]  # more processes than items: repeat the last one
        if not apply_padding:
            return part
    else:
        part = value[start:end]
    if not apply_padding or len(part) >= target or length == 0:
        return part
    missing = target - len(part)
    if isinstance(value, torch.Tensor):
        return torch.cat([part, part[-1:].expand(missing, *part.shape[1:])], dim=0)
    filler = [part[-1]] * missing
    return part + (tuple(filler) if isinstance(part, tuple) else filler)


def split_inputs(inputs: Any, num_processes: int, index: int, apply_padding: bool = False) -> Any:
    """Process ``index``'s contiguous share of ``inputs`` (list, tuple, tensor, or a dict of those).

    Example:
        >>> split_inputs([1, 2, 3], 2, 1)
        [3]
        >>> split_inputs([1, 2, 3], 2, 1, apply_padding=True)
        [3, 3]

    Raises:
        TypeError: an unsupported type.
        ValueError: dict values of different lengths.
    """
    if isinstance(inputs, Mapping):
        lengths = {k: _length(v, f"inputs[{k!r}]") for k, v in inputs.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"split_between_processes: all values of a dict must have the same length, got {lengths}")
        if num_processes == 1:
            return inputs
        return cast(Any, type(inputs))({k: _split_one(v, num_processes, index, apply_padding) for k, v in inputs.items()})
    _length(inputs, "inputs")
    if num_processes == 1:
        return inputs
    return _split_one(inputs, num_processes, index, apply_padding)


def _length(value: Any, name: str) -> int:
    if isinstance(value, torch.Tensor) and value.ndim > 0:
        return int(value.shape[0])
    if isinstance(value, (list, tuple)):
        return len(value)
    if hasattr(value, "select") and hasattr(value, "__len__"):  # a datasets.Dataset
        return len(value)
    raise TypeError(f"split_between_processes: {name} is a {type(value).__name__}; supported are list, tuple, "
                    "tensor (at least 1-d), datasets.Dataset, or a dict of those")
