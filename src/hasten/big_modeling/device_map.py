"""Automatic device maps: ``infer_auto_device_map``, ``clean_device_map``, ``check_device_map``.

The greedy walk follows Accelerate's algorithm step for step (so maps are identical), split into
small helpers. Devices are filled in order: GPUs (as ordered in ``max_memory``), ``"cpu"``, ``"disk"``.
"""

from __future__ import annotations

import logging
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hasten.big_modeling.sizes import (
    compute_module_sizes,
    get_max_layer_size,
    get_max_memory,
)
from hasten.big_modeling.tensors import dtype_byte_size, find_tied_parameters, is_integer_dtype, str_to_dtype

logger = logging.getLogger(__name__)

__all__ = ["check_device_map", "clean_device_map", "infer_auto_device_map"]


def _owns(prefix: str, name: str) -> bool:
    """True when tensor/module ``name`` is ``prefix`` or lies inside it."""
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


@dataclass
class _Walk:
    """The mutable state of one ``infer_auto_device_map`` run."""

    devices: list[Any]
    max_memory: dict[Any, int]
    main_devices: list[Any]
    sizes: Mapping[str, int]
    tied: list[list[str]]
    no_split: list[str]
    todo: list[tuple[str, Any]]
    device_map: OrderedDict[str, Any] = field(default_factory=OrderedDict)
    used: dict[Any, int] = field(default_factory=dict)
    buffers: dict[Any, int] = field(default_factory=dict)
    minimum: dict[Any, int] = field(default_factory=dict)
    current: int = 0
    max_layer: int = 0
    max_layer_names: list[str] = field(default_factory=list)
    model: nn.Module | None = None
    _buffer_table: Mapping[str, int] | None = None

    def refresh_max_layer(self) -> None:
        modules = [(n, m) for n, m in self.todo if isinstance(m, nn.Module)]
        self.max_layer, self.max_layer_names = get_max_layer_size(modules, self.sizes, self.no_split)

    def buffer_bytes(self, name: str, module: nn.Module, dtype: Any) -> int:
        """Bytes of the buffers under module ``name``, from one table built on first use (not a walk per module)."""
        if self._buffer_table is None:
            table: dict[str, int] = {}
            size = dtype_byte_size(str_to_dtype(dtype)) if dtype is not None else None
            for full, buffer in self.model.named_buffers(remove_duplicate=False):  # shared modules under each name
                own = dtype_byte_size(buffer.dtype)
                nbytes = buffer.numel() * (own if size is None or is_integer_dtype(buffer.dtype) else min(size, own))
                parts = full.split(".")
                for index in range(1, len(parts)):
                    prefix = ".".join(parts[:index])
                    table[prefix] = table.get(prefix, 0) + nbytes
            self._buffer_table = table
        return int(self._buffer_table.get(name, 0))

    def index_of(self, name: str) -> int | None:
        return next((i for i, (n, _) in enumerate(self.todo) if n == name), None)


def _split_children(name: str, module: Any) -> list[tuple[str, Any]]:
    if isinstance(module, torch.Tensor):
        return []
    children = list(module.named_parameters(recurse=False)) + list(module.named_children())
    return [(f"{name}.{n}", m) for n, m in children]


def _tied_outside(walk: _Walk, name: str) -> list[str]:
    """Tied parameters living outside ``name`` whose group has a member inside it."""
    outside: list[str] = []
    for group in walk.tied:
        inside = [_owns(name, p) for p in group]
        if any(inside) and not all(inside):
            outside += [p for p, flag in zip(group, inside) if not flag]
    return outside


def _size_with_ties(walk: _Walk, size: int, tied_params: list[str]) -> tuple[int, list[str], list[Any]]:
    names: list[str] = []
    modules: list[Any] = []
    total = size
    for param in tied_params:
        match = next(((n, m) for n, m in walk.todo if _owns(n, param)), None)
        if match is None or match[0] in names:  # already placed, or counted through another tied param
            continue
        names.append(match[0])
        modules.append(match[1])
        total += walk.sizes[match[0]] - walk.sizes[param]
    return total, names, modules


def _assign(walk: _Walk, name: str, module: Any, device: Any, size: int, tied_names: list[str],
            offload_buffers: bool, dtype: Any, special_dtypes: Any) -> None:
    walk.used[device] += size
    walk.device_map[name] = device
    for tied_name in tied_names:
        index = walk.index_of(tied_name)
        if index is not None:
            walk.todo.pop(index)
        walk.device_map[tied_name] = device
    if not offload_buffers and isinstance(module, nn.Module):
        walk.buffers[device] = walk.buffers.get(device, 0) + walk.buffer_bytes(name, module, dtype)


def _split_a_tied_module(walk: _Walk, name: str, module: Any, tied_names: list[str], tied_modules: list[Any]) -> bool:
    """Replace one splittable tied module by its children (so the current module may fit); True if done."""
    for tied_name, tied_module in zip(tied_names, tied_modules):
        if isinstance(tied_module, torch.Tensor) or not list(tied_module.named_children()) \
                or type(tied_module).__name__ in walk.no_split:
            continue
        index = walk.index_of(tied_name)
        if index is None:
            continue
        walk.todo = [(name, module)] + walk.todo[:index] + _split_children(tied_name, tied_module) + walk.todo[index + 1:]
        walk.refresh_max_layer()
        return True
    return False


def _fallback(walk: _Walk, limit: float) -> tuple[str, Any] | None:
    """Breadth-first search for any module (with its ties) that fits in ``limit`` bytes; removed from todo."""
    queue = list(walk.todo)
    while queue:
        name, module = queue.pop(0)
        size, _, _ = _size_with_ties(walk, walk.sizes[name], _tied_outside(walk, name))
        if size <= limit:
            index = walk.index_of(name)
            if index is not None:
                walk.todo.pop(index)
            else:  # a descendant of a pending module: split that ancestor around it
                parent = next(i for i, (n, _) in enumerate(walk.todo) if _owns(n, name))
                pname, pmodule = walk.todo.pop(parent)
                walk.todo[parent:parent] = _expand_without(pname, pmodule, name)
            return name, module
        if isinstance(module, nn.Module) and type(module).__name__ not in walk.no_split:
            queue.extend(_split_children(name, module))
    return None


def _expand_without(name: str, module: Any, target: str) -> list[tuple[str, Any]]:
    """The pieces of ``module`` that remain once ``target`` (a descendant) is taken out."""
    pieces: list[tuple[str, Any]] = []
    for child_name, child in _split_children(name, module):
        if child_name == target:
            continue
        if _owns(child_name, target):
            pieces += _expand_without(child_name, child, target)
        else:
            pieces.append((child_name, child))
    return pieces


def _init_walk(model: nn.Module, max_memory: Any, no_split: Any, dtype: Any, special_dtypes: Any,
               sizes: Mapping[str, int] | None = None) -> _Walk:
    budget = get_max_memory(max_memory)
    if no_split is None:
        no_split = []
    elif not isinstance(no_split, (list, tuple)):
        no_split = [no_split]
    devices = list(budget)
    if "disk" not in devices:
        devices.append("disk")
    gpus = [d for d in devices if d not in ("cpu", "disk")]
    main = ["mps"] if "mps" in gpus else ([gpus[0], "cpu"] if gpus else ["cpu"])
    todo = (list(model.named_parameters(recurse=False)) + list(model.named_children())
            + list(model.named_buffers(recurse=False)))
    walk = _Walk(devices=devices, max_memory=budget, main_devices=main, no_split=list(no_split), todo=todo,
                 sizes=sizes if sizes is not None else compute_module_sizes(model, dtype=dtype,
                                                                            special_dtypes=special_dtypes),
                 tied=find_tied_parameters(model), model=model)
    walk.used = {d: 0 for d in devices}
    walk.refresh_max_layer()
    return walk


def infer_auto_device_map(model: nn.Module, max_memory: Mapping[Any, int | str] | None = None,
                          no_split_module_classes: list[str] | None = None, dtype: str | torch.dtype | None = None,
                          special_dtypes: Mapping[str, str | torch.dtype] | None = None, verbose: bool = False,
                          clean_result: bool = True, offload_buffers: bool = False,
                          fallback_allocation: bool = False) -> OrderedDict[str, int | str]:
    """Place ``model``'s modules on GPUs first, then the CPU, then disk, within ``max_memory``.

    The first GPU and the CPU keep room for the largest layer (so an offloaded layer can be brought back
    to run); tied parameters are placed together; modules whose class is in ``no_split_module_classes``
    are never split. With ``max_memory`` given, no accelerator is queried.

    Example:
        >>> infer_auto_device_map(model, max_memory={0: "1GB", 1: "1GB", "cpu": "2GB"},
        ...                       no_split_module_classes=["Block"])
        OrderedDict([('embed', 0), ('blocks.0', 0), ..., ('head', 1)])
    """
    return _walk_device_map(model, max_memory, no_split_module_classes, dtype, special_dtypes, verbose, clean_result,
                            offload_buffers, fallback_allocation)


def _walk_device_map(model: nn.Module, max_memory: Any, no_split_module_classes: Any, dtype: Any, special_dtypes: Any,
                     verbose: bool = False, clean_result: bool = True, offload_buffers: bool = False,
                     fallback_allocation: bool = False,
                     sizes: Mapping[str, int] | None = None) -> OrderedDict[str, int | str]:
    """``infer_auto_device_map``, reusing ``sizes`` when the caller already computed them (``device_map="auto"``)."""
    walk = _init_walk(model, max_memory, no_split_module_classes, dtype, special_dtypes, sizes)
    while walk.todo:
        name, module = walk.todo.pop(0)
        if verbose:
            print(f"\nTreating module {name}.")
        walk.max_layer_names = [n for n in walk.max_layer_names if not _owns(name, n)]
        if not walk.max_layer_names:
            walk.refresh_max_layer()
        _place_one(walk, name, module, verbose, offload_buffers, dtype, special_dtypes, fallback_allocation)
    if clean_result:
        clean_device_map(walk.device_map)
    _report(walk, offload_buffers)
    return walk.device_map


def _place_one(walk: _Walk, name: str, module: Any, verbose: bool, offload_buffers: bool, dtype: Any,
               special_dtypes: Any, fallback_allocation: bool) -> None:
    """One step of the greedy walk: assign, split, or move on to the next device."""
    size = walk.sizes[name]
    tied_params = _tied_outside(walk, name)
    device = walk.devices[walk.current]
    limit = walk.max_memory[device] if device != "disk" else None
    reserved = 0
    if device in walk.main_devices and limit is not None:
        limit -= walk.max_layer  # keep room to bring back the largest offloaded layer
        reserved = walk.max_layer
    with_ties, tied_names, tied_modules = _size_with_ties(walk, size, tied_params)
    if limit is None or walk.used[device] + with_ties <= limit:
        if verbose:
            print(f"Putting {name} (size={with_ties}) on {device} (available={limit}).")
        _assign(walk, name, module, device, with_ties, tied_names, offload_buffers, dtype, special_dtypes)
        return
    if tied_params and walk.used[device] + size <= limit:
        if _split_a_tied_module(walk, name, module, tied_names, tied_modules):
            return
    if walk.used[device] + size >= limit:
        if isinstance(module, nn.Module) and list(module.named_children()) \
                and type(module).__name__ not in walk.no_split:
            if verbose:
                print(f"Splitting {name}.")
            walk.todo = _split_children(name, module) + walk.todo
            walk.refresh_max_layer()
            return
    if walk.used[device] == 0 and fallback_allocation and device != "disk":
        room = walk.max_memory[device] - max(walk.max_layer, with_ties)
        found = _fallback(walk, room - walk.used[device])
        if found is not None:
            walk.todo = [found, (name, module)] + walk.todo
            return
    if walk.used[device] == 0:
        walk.minimum[device] = with_ties + reserved
    walk.used[device] += reserved
    walk.current += 1
    walk.todo.insert(0, (name, module))


def _report(walk: _Walk, offload_buffers: bool) -> None:
    used = {d: m for d, m in walk.used.items() if m > 0}
    offloaded_buffers = walk.buffers.get("cpu", 0) + walk.buffers.get("disk", 0)
    gpus = [d for d in walk.max_memory if d not in ("cpu", "disk")]
    if offloaded_buffers > 0 and not offload_buffers and gpus:
        fits = any(walk.max_memory[g] >= offloaded_buffers + used.get(g, 0) for g in gpus)
        if not fits:
            warnings.warn("Current model requires " f"{offloaded_buffers} bytes of buffer for offloaded layers, "
                          "which seems not to fit any GPU's remaining memory. If you are experiencing a OOM "
                          "later, please consider using offload_buffers=True.", stacklevel=3)
    if walk.minimum:
        lines = "\n".join(f"  - {d}: {m} bytes required" for d, m in walk.minimum.items())
        logger.info("No modules could be assigned to the following devices due to insufficient memory:\n%s\n"
                    "Increase the memory of these devices to at least the amount shown, or change the model.",
                    lines)


def clean_device_map(device_map: dict[str, Any], module_name: str = "") -> dict[str, Any]:
    """Merge, recursively, the entries under ``module_name`` that all sit on one device into one entry.

    Example:
        >>> clean_device_map({"a.0": 0, "a.1": 0, "b": 1})
        {'b': 1, 'a': 0}
    """
    prefix = f"{module_name}." if module_name else ""
    keys = [k for k in device_map if k.startswith(prefix)]
    values = [device_map[k] for k in keys]
    if len(values) > 1 and len(set(map(str, values))) == 1:
        for key in keys:
            del device_map[key]
        device_map[module_name] = values[0]
    depth = len(module_name.split(".")) + 1 if module_name else 1
    children = {".".join(k.split(".")[:depth]) for k in device_map if k.startswith(prefix) and len(k) > len(module_name)}
    for child in sorted(children):
        clean_device_map(device_map, module_name=child)
    return device_map


def check_device_map(model: nn.Module, device_map: Mapping[str, Any]) -> None:
    """Raise if some parameter or buffer of ``model`` is covered by no entry of ``device_map``.

    Example:
        >>> check_device_map(nn.Linear(2, 2), {"": "cpu"})
    """
    if not isinstance(device_map, Mapping):
        raise TypeError(f"`device_map` must be a dict of module name -> device, got {type(device_map).__name__}.")
    if "" in device_map:
        return
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    keys = list(device_map)
    missing = [n for n in names if not any(_owns(k, n) for k in keys)]
    if missing:
        raise ValueError(f"The device_map provided does not give any device for the following parameters: "
                         f"{', '.join(missing)}. HINT: add their modules (e.g. {missing[0].rsplit('.', 1)[0]!r}) "
                         "to the device_map, or use device_map='auto'.")
    modules = {n for n, _ in model.named_modules()} | set(names)
    unknown = [k for k in keys if k not in modules]
    if unknown:
        warnings.warn(f"The device_map names modules the model does not have: {', '.join(unknown)}.", stacklevel=2)
