"""Tensor-level helpers for big models: dtype sizes, named tensors, moving one tensor, tied parameters."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

_INT_PREFIXES = ("torch.uint", "torch.int", "torch.bool")


def is_integer_dtype(dtype: torch.dtype) -> bool:
    """True for integer and bool dtypes, which are never cast when loading (Accelerate's rule)."""
    return str(dtype).startswith(_INT_PREFIXES)


def dtype_byte_size(dtype: torch.dtype | str) -> float:
    """Bytes taken by one element of ``dtype`` (``bool`` is 1/8, ``int4`` 1/2, ``int2`` 1/4, fp8 1).

    Example:
        >>> dtype_byte_size(torch.float16)
        2
    """
    if isinstance(dtype, torch.dtype):
        known = _DTYPE_BYTES.get(dtype)
        if known is not None:  # the per-tensor path of every size computation: no string parsing
            return known
    if isinstance(dtype, str):
        dtype = str_to_dtype(dtype) if not dtype.startswith(("int4", "int2", "fp8", "float8")) else dtype
    if dtype == torch.bool:
        return 1 / 8
    name = str(dtype)
    if name.endswith("int4"):
        return 1 / 2
    if name.endswith("int2"):
        return 1 / 4
    if "float8" in name or name.endswith("fp8"):
        return 1
    match = re.search(r"[^\d](\d+)_?", name)
    if match is None:
        raise ValueError(f"`dtype` is not a valid dtype: {dtype}.")
    return int(match.groups()[0]) // 8


_DTYPE_BYTES: dict[torch.dtype, float] = {
    torch.float32: 4, torch.float16: 2, torch.bfloat16: 2, torch.float64: 8, torch.int64: 8, torch.int32: 4,
    torch.int16: 2, torch.int8: 1, torch.uint8: 1, torch.bool: 1 / 8, torch.complex64: 8,
}


def str_to_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float16"`` / ``"torch.float16"`` / ``"fp16"`` / ``"bf16"`` -> ``torch.float16`` and friends."""
    if isinstance(dtype, torch.dtype):
        return dtype
    aliases = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "half": "float16", "float": "float32"}
    name = dtype.replace("torch.", "")
    name = aliases.get(name, name)
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"`dtype` {dtype!r} is not a torch dtype: use e.g. 'float32', 'float16' or 'bfloat16'.")
    return value


def named_module_tensors(module: nn.Module, include_buffers: bool = True, recurse: bool = False,
                         remove_non_persistent: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters, then buffers, of ``module`` with their names.

    Args:
        module: the module.
        include_buffers: also yield buffers.
        recurse: walk the submodules too.
        remove_non_persistent: skip buffers registered with ``persistent=False``.

    Example:
        >>> [n for n, _ in named_module_tensors(nn.Linear(2, 2))]
        ['weight', 'bias']
    """
    yield from module.named_parameters(recurse=recurse)
    if include_buffers:
        skip = get_non_persistent_buffers(module, recurse=recurse, fqns=True) if remove_non_persistent else set()
        for name, buf in module.named_buffers(recurse=recurse):
            if name not in skip:
                yield name, buf


def get_non_persistent_buffers(module: nn.Module, recurse: bool = False, fqns: bool = False) -> set[str]:
    """Names of the buffers registered with ``persistent=False``: the module's own, or with ``recurse``
    its submodules' too (their bare names, or dotted paths with ``fqns``), as Accelerate returns them."""
    names = set(module._non_persistent_buffers_set)
    if recurse:
        for prefix, sub in module.named_modules():
            if fqns:
                names |= {f"{prefix}.{n}" if prefix else n for n in sub._non_persistent_buffers_set}
            else:
                names |= sub._non_persistent_buffers_set
    return names


def get_submodule_and_name(module: nn.Module, tensor_name: str) -> tuple[nn.Module, str]:
    """Resolve ``"a.b.weight"`` to ``(module.a.b, "weight")``, with an error naming the missing part."""
    *path, leaf = tensor_name.split(".")
    for part in path:
        child = getattr(module, part, None)
        if not isinstance(child, nn.Module):
            raise ValueError(f"{type(module).__name__} has no submodule {part!r} (looking up {tensor_name!r}).")
        module = child
    return module, leaf


def as_torch_device(device: int | str | torch.device) -> torch.device:
    """One key per device for the tied-parameters map: ``0``, ``"cuda:0"`` and ``torch.device("cuda", 0)`` agree."""
    if isinstance(device, torch.device):
        return device
    known = _DEVICES.get(device)
    if known is None:
        known = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if len(_DEVICES) < 64:  # device names are few; a bound keeps a pathological caller from growing it
            _DEVICES[device] = known
    return known


_DEVICES: dict[int | str, torch.device] = {}


def _tied_copy(tied_params_map: dict[int, dict[Any, torch.Tensor]] | None, device_key: torch.device,
               value: torch.Tensor | None, old_value: torch.Tensor | None) -> torch.Tensor | None:
    if tied_params_map is None or old_value is None:
        return None
    for ptr in ((value.data_ptr(),) if value is not None else ()) + (old_value.data_ptr(),):
        if ptr and ptr in tied_params_map and device_key in tied_params_map[ptr]:
            return tied_params_map[ptr][device_key]
    return None


def _same_device(a: torch.device, b: torch.device | str | int) -> bool:
    b = as_torch_device(b)
    if a == b:
        return True
    if a.type != b.type:
        return False
    return a.index == b.index or (a.type == "cuda" and (a.index or 0) == (b.index or 0))


def set_module_tensor_to_device(module: nn.Module, tensor_name: str, device: int | str | torch.device,
                                value: torch.Tensor | None = None, dtype: str | torch.dtype | None = None,
                                fp16_statistics: torch.Tensor | None = None,
                                tied_params_map: dict[int, dict[Any, torch.Tensor]] | None = None,
                                non_blocking: bool = False, clear_cache: bool = True) -> None:
    """Put the parameter/buffer ``tensor_name`` of ``module`` on ``device`` (with ``value`` as its data if given).

    Without ``dtype`` a given ``value`` takes the dtype of the current tensor (as ``load_state_dict`` does);
    with ``dtype``, floating-point values are cast to it. ``tied_params_map`` ({data_ptr: {device: tensor}})
    lets tied weights share one copy per device.

    Example:
        >>> with init_empty_weights():
        ...     layer = nn.Linear(2, 2)
        >>> set_module_tensor_to_device(layer, "weight", "cpu", value=torch.zeros(2, 2))
    """
    module, name = get_submodule_and_name(module, tensor_name)
    if name not in module._parameters and name not in module._buffers:
        raise ValueError(f"{type(module).__name__} has no parameter or buffer named {name!r} ({tensor_name!r}).")
    is_buffer = name in module._buffers
    # Any: torch's stubs type these tables' values as optional; the name was checked just above.
    old_value: Any = module._buffers[name] if is_buffer else module._parameters[name]
    device_key = as_torch_device(device)
    if tied_params_map is not None:
        shared: Any = _tied_copy(tied_params_map, device_key, value, old_value)
        if shared is not None:
            module._parameters[name] = shared  # reuse the copy of this tied weight already on `device`
            return
    if old_value is not None and old_value.device.type == "meta" and device_key.type != "meta" and value is None:
        raise ValueError(f"{tensor_name} is on the meta device: a `value` is needed to put it on {device}.")
    if value is not None:
        if old_value is not None and old_value.shape != value.shape:
            raise ValueError(f"Trying to set a tensor of shape {tuple(value.shape)} in {tensor_name!r} (which has "
                             f"shape {tuple(old_value.shape)}): the checkpoint does not match the model.")
        if dtype is None and old_value is not None:
            if value.dtype != old_value.dtype:
                value = value.to(old_value.dtype, non_blocking=non_blocking)
        elif dtype is not None and not is_integer_dtype(value.dtype):
            value = value.to(str_to_dtype(dtype), non_blocking=non_blocking)
    if value is None:
        with torch.no_grad():  # the old value is a Parameter: the move must not be recorded by autograd
            new_value = old_value.to(device_key, non_blocking=non_blocking)
        if dtype is not None and device_key.type == "meta" and not is_integer_dtype(old_value.dtype):
            new_value = new_value.to(str_to_dtype(dtype))
    elif isinstance(value, torch.Tensor):
        if value.device == device_key:
            new_value = value  # what `.to` would return, without its dispatch cost (paid per tensor per load)
        else:
            with torch.no_grad():
                new_value = value.to(device_key, non_blocking=non_blocking)
    else:
        new_value = torch.tensor(value, device=device_key)
    if is_buffer:
        module._buffers[name] = new_value
    elif value is not None or not _same_device(old_value.device, device_key) or (
            dtype is not None and new_value.dtype != old_value.dtype):
        param_cls = type(old_value)
        requires_grad = old_value.requires_grad and new_value.is_floating_point()
        try:
            new_param = param_cls(new_value, requires_grad=requires_grad)
        except TypeError:  # parameter subclasses with extra required arguments
            new_param = nn.Parameter(new_value, requires_grad=requires_grad)
        module._parameters[name] = new_param
        new_value = new_param
    if tied_params_map is not None:
        for ptr in (old_value.data_ptr() if old_value is not None else 0,
                    value.data_ptr() if isinstance(value, torch.Tensor) else 0):
            if ptr and ptr in tied_params_map and device_key not in tied_params_map[ptr]:
                tied_params_map[ptr][device_key] = new_value
                break


def find_tied_parameters(model: nn.Module, **kwargs: Any) -> list[list[str]]:
    """Groups of parameter names that share one ``Parameter`` object, each group sorted.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        >>> model[1].weight = model[0].weight
        >>> find_tied_parameters(model)
        [['0.weight', '1.weight']]
    """
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return sorted(sorted(names) for names in groups.values() if len(names) > 1)


def retie_parameters(model: nn.Module, tied_params: list[list[str]]) -> None:
    """Make every name of each group point at the group's first non-meta parameter again.

    Example:
        >>> retie_parameters(model, find_tied_parameters(model))
    """
    for group in tied_params:
        source = None
        for name in group:
            owner, leaf = get_submodule_and_name(model, name)
            param = getattr(owner, leaf)
            if param.device.type != "meta":
                source = param
                break
        if source is None:
            continue
        for name in group:
            owner, leaf = get_submodule_and_name(model, name)
            setattr(owner, leaf, source)


def id_tensor_storage(tensor: torch.Tensor) -> tuple[torch.device, int, int]:
    """A key equal for tensors sharing storage: (device, storage pointer, storage size)."""
    if tensor.device.type == "meta":
        return tensor.device, id(tensor), 0
    storage = tensor.untyped_storage()
    return tensor.device, storage.data_ptr(), storage.nbytes()


def has_offloaded_params(module: nn.Module) -> bool:
    """True when ``module`` carries an offloading ``AlignDevicesHook``."""
    hook = getattr(module, "_hf_hook", None)
    return hook is not None and bool(getattr(hook, "offload", False))
