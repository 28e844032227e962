"""Stateless helpers over nested structures of tensors (lists, tuples, namedtuples, dicts)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import torch


def is_torch_tensor(tensor: Any) -> bool:
    """True for a ``torch.Tensor``."""
    return isinstance(tensor, torch.Tensor)


def is_namedtuple(data: Any) -> bool:
    """True for an instance of a ``collections.namedtuple`` class."""
    return isinstance(data, tuple) and hasattr(data, "_asdict") and hasattr(data, "_fields")


def honor_type(obj: Any, generator: Any) -> Any:
    """Build a sequence of the same type as ``obj`` from ``generator`` (namedtuples included)."""
    if is_namedtuple(obj):
        return type(obj)(*list(generator))
    return type(obj)(generator)


def recursively_apply(func: Callable[..., Any], data: Any, *args: Any, test_type: Callable[[Any], bool] = is_torch_tensor,
                      error_on_other_type: bool = False, **kwargs: Any) -> Any:
    """Apply ``func`` to every leaf of ``data`` that passes ``test_type``, keeping container types.

    Example:
        >>> recursively_apply(lambda t: t * 2, {"a": [torch.ones(1)]})
        {'a': [tensor([2.])]}

    Raises:
        TypeError: a leaf fails ``test_type`` and ``error_on_other_type`` is set.
    """
    if isinstance(data, (tuple, list)):
        return honor_type(data, (recursively_apply(func, o, *args, test_type=test_type,
                                                   error_on_other_type=error_on_other_type, **kwargs) for o in data))
    if isinstance(data, Mapping):
        return cast(Any, type(data))({k: recursively_apply(func, v, *args, test_type=test_type,
                                                error_on_other_type=error_on_other_type, **kwargs)
                           for k, v in data.items()})
    if test_type(data):
        return func(data, *args, **kwargs)
    if error_on_other_type:
        raise TypeError(
            f"Unsupported type {type(data).__name__} passed to `{getattr(func, '__name__', func)}`: only tensors in "
            "nested lists, tuples and dicts are supported. HINT: use `gather_object` for other Python objects.")
    return data


def send_to_device(tensor: Any, device: torch.device | str | int, non_blocking: bool = False,
                   skip_keys: list[str] | str | None = None) -> Any:
    """Move every tensor (or object with a ``.to`` method) in a nested structure to ``device``.

    Args:
        tensor: the data.
        device: the target device.
        non_blocking: asynchronous copy where the hardware allows it.
        skip_keys: dict keys whose values are left where they are.

    Example:
        >>> send_to_device({"x": torch.ones(2)}, "cpu")["x"].device.type
        'cpu'
    """
    if isinstance(skip_keys, str):
        skip_keys = [skip_keys]
    if isinstance(tensor, (tuple, list)):
        return honor_type(tensor, (send_to_device(t, device, non_blocking, skip_keys) for t in tensor))
    if isinstance(tensor, Mapping):
        skip = skip_keys or []
        return cast(Any, type(tensor))({k: t if k in skip else send_to_device(t, device, non_blocking, skip_keys)
                             for k, t in tensor.items()})
    if isinstance(tensor, torch.Tensor) or hasattr(tensor, "to"):
        if isinstance(tensor, torch.Tensor) and _same_device(tensor.device, device):
            return tensor  # already there: skip the call (per-step hot path)
        try:
            return tensor.to(device, non_blocking=non_blocking)
        except TypeError:  # objects whose .to takes no non_blocking
            return tensor.to(device)
    return tensor


def _same_device(current: torch.device, target: torch.device | str | int) -> bool:
    if isinstance(target, int):
        return current.type != "cpu" and current.index == target
    target = torch.device(target)
    if target.index is None and target.type != "cpu":
        return False  # "cuda" means the current device; let .to() decide
    return current == target


def get_data_structure(data: Any) -> Any:
    """Replace every tensor by its shape and dtype (useful to build receive buffers)."""
    return recursively_apply(lambda t: (tuple(t.shape), t.dtype), data)


def find_batch_size(data: Any) -> int | None:
    """The size of the first dimension of the first tensor found in ``data``.

    Raises:
        TypeError: no tensor is found in ``data``.
    """
    if isinstance(data, (tuple, list, Mapping)) and len(data) == 0:
        raise TypeError(f"Cannot find the batch size from an empty {type(data).__name__}.")
    if isinstance(data, (tuple, list)):
        return find_batch_size(data[0])
    if isinstance(data, Mapping):
        for value in data.values():
            return find_batch_size(value)
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"Cannot find the batch size from a {type(data).__name__}: expected tensors.")
    return int(data.shape[0]) if data.dim() > 0 else None


def ignorant_find_batch_size(data: Any) -> int | None:
    """Like :func:`find_batch_size` but returns None instead of raising."""
    try:
        return find_batch_size(data)
    except (TypeError, IndexError):
        return None


def listify(data: Any) -> Any:
    """Turn tensors into (nested) Python lists of numbers."""
    return recursively_apply(lambda t: t.tolist() if t.dim() > 0 else t.item(), data)


def concatenate(data: list[Any], dim: int = 0) -> Any:
    """Concatenate a list of same-structured nested tensors along ``dim``.

    Example:
        >>> concatenate([{"a": torch.ones(1)}, {"a": torch.zeros(1)}])
        {'a': tensor([1., 0.])}
    """
    if not isinstance(data, (list, tuple)) or len(data) == 0:
        raise TypeError(f"concatenate expects a non-empty list of structures, got {type(data).__name__}")
    first = data[0]
    if isinstance(first, (tuple, list)):
        return honor_type(first, (concatenate([d[i] for d in data], dim=dim) for i in range(len(first))))
    if isinstance(first, Mapping):
        return cast(Any, type(first))({k: concatenate([d[k] for d in data], dim=dim) for k in first.keys()})
    if not isinstance(first, torch.Tensor):
        raise TypeError(f"Can only concatenate tensors but got {type(first).__name__}")
    return torch.cat(list(data), dim=dim)


def slice_tensors(data: Any, tensor_slice: slice | int, process_index: int | None = None,
                  num_processes: int | None = None) -> Any:
    """Apply ``tensor_slice`` to every tensor of a nested structure.

    ``process_index`` and ``num_processes`` are accepted for Accelerate compatibility (its XLA path
    used them); the slice alone decides the result.
    """
    return recursively_apply(lambda t: t[tensor_slice], data)


def convert_to_fp32(tensor: Any) -> Any:
    """Upcast every fp16/bf16 tensor of a nested structure to fp32."""
    return recursively_apply(lambda t: t.float(), tensor,
                             test_type=lambda t: isinstance(t, torch.Tensor) and t.dtype in (torch.float16, torch.bfloat16))


def find_device(data: Any) -> torch.device | None:
    """The device of the first tensor found in ``data``."""
    if isinstance(data, Mapping):
        for obj in data.values():
            device = find_device(obj)
            if device is not None:
                return device
    elif isinstance(data, (tuple, list)):
        for obj in data:
            device = find_device(obj)
            if device is not None:
                return device
    elif isinstance(data, torch.Tensor):
        return data.device
    return None
