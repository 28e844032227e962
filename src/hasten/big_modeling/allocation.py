"""Accelerate's device-map building blocks as standalone functions (``accelerate.utils.modeling``):
device comparison, leaf modules, module sizes with tied parameters, the breadth-first fallback search,
and reading an offloaded module's weights into a state dict.

``infer_auto_device_map`` (:mod:`hasten.big_modeling.device_map`) keeps its own walk state; these take
the same inputs as Accelerate's, for code that builds device maps by hand.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hasten.base.sizes import convert_file_size_to_int
from hasten.big_modeling.extras import align_module_device
from hasten.big_modeling.tensors import has_offloaded_params


def check_device_same(first_device: torch.device, second_device: torch.device) -> bool:
    """Whether two devices are the same, with an accelerator's missing index read as 0
    (``cuda`` is ``cuda:0``; torch's ``==`` says they differ).

    Example:
        >>> check_device_same(torch.device("cpu"), torch.device("cpu"))
        True
    """
    if first_device.type != second_device.type:
        return False
    if first_device.type != "cpu" and first_device.index is None:
        first_device = torch.device(first_device.type, index=0)
    if second_device.type != "cpu" and second_device.index is None:
        second_device = torch.device(second_device.type, index=0)
    return first_device == second_device


def get_module_leaves(module_sizes: dict[str, int]) -> list[str]:
    """The names in ``module_sizes`` (as from ``compute_module_sizes``) that have no child entry."""
    children: dict[str, int] = {}
    for name in module_sizes:
        if name and "." in name:
            parent = name.rsplit(".", 1)[0]
            children[parent] = children.get(parent, 0) + 1
    return [name for name in module_sizes if name and children.get(name, 0) == 0]


def get_module_size_with_ties(tied_params: list[str], module_size: int, module_sizes: dict[str, int],
                              modules_to_treat: list[tuple[str, Any]]) -> tuple[int, list[str], list[Any]]:
    """A module's size plus the modules holding its tied parameters (which must go to the same device).

    Returns:
        The total size, the names of the tied modules and the modules themselves.
    """
    names: list[str] = []
    modules: list[Any] = []
    for param in tied_params:
        index = next(i for i, (n, _) in enumerate(modules_to_treat) if param.startswith(n + "."))
        names.append(modules_to_treat[index][0])
        modules.append(modules_to_treat[index][1])
    total = module_size
    for param, name in zip(tied_params, names):
        total += module_sizes[name] - module_sizes[param]
    return total, names, modules


def _children(module: Any) -> list[tuple[str, Any]]:
    if isinstance(module, torch.Tensor):
        return []
    return list(module.named_parameters(recurse=False)) + list(module.named_children())


def fallback_allocate(modules: list[tuple[str, Any]], module_sizes: dict[str, int], size_limit: int | str,
                      no_split_module_classes: list[str] | None = None,
                      tied_parameters: list[list[str]] | None = None) -> tuple[str | None, Any, list[tuple[str, Any]]]:
    """Breadth-first search of ``modules`` (splitting what may be split) for one that fits in ``size_limit``
    with its tied parameters.

    Returns:
        ``(name, module, remaining)``: the module found and the list without it (its ancestors replaced by
        their other children), or ``(None, None, modules)`` when nothing fits.
    """
    try:
        limit = convert_file_size_to_int(size_limit)
    except ValueError:
        return None, None, modules
    no_split = no_split_module_classes or []
    tied = tied_parameters or []
    queue = list(modules)
    found = None
    while queue:
        name, module = queue.pop(0)
        groups = [g for g in tied if any(name + "." in k + "." for k in g) and not all(name + "." in k + "." for k in g)]
        outside = [p for g in groups for p in g if name + "." not in p + "."]
        size, _, _ = get_module_size_with_ties(outside, module_sizes[name], module_sizes, queue)
        if size <= limit:
            found = name
            break
        children = [] if isinstance(module, (nn.Parameter, torch.Tensor)) else list(module.named_children())
        if not children or type(module).__name__ in no_split:
            continue
        queue = [(f"{name}.{n}", v) for n, v in _children(module)] + queue
    if found is None:
        return None, None, modules
    for dot in [i for i, c in enumerate(found) if c == "."]:  # replace each listed ancestor by its children
        parent = found[:dot]
        names = [n for n, _ in modules]
        if parent in names:
            index = names.index(parent)
            modules = modules[:index] + [(f"{parent}.{n}", v) for n, v in _children(modules[index][1])] \
                + modules[index + 1:]
    index = [n for n, _ in modules].index(found)
    name, module = modules.pop(index)
    return name, module, modules


def get_state_dict_from_offload(module: nn.Module, module_name: str, state_dict: dict[str, Any],
                                device_to_put_offload: int | str | torch.device = "cpu") -> dict[str, Any]:
    """Fill ``state_dict``'s entries of ``module`` (named by one of its tensors, ``module_name``) with its
    real weights, loaded onto ``device_to_put_offload`` when the module is offloaded."""
    root = module_name[: module_name.rfind(".")]
    device: torch.device | str | None = None
    if has_offloaded_params(module):
        device = torch.device(device_to_put_offload) if isinstance(device_to_put_offload, int) else device_to_put_offload
    with align_module_device(module, device):
        for key, value in module.state_dict().items():
            if f"{root}.{key}" in state_dict:
                state_dict[f"{root}.{key}"] = value
    return state_dict
