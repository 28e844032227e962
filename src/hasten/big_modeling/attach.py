"""Attaching ``AlignDevicesHook``s over a module tree (what ``dispatch_model`` and the offload helpers use)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hasten.big_modeling.hooks import AlignDevicesHook, WeightPrefetcher, add_hook_to_module
from hasten.big_modeling.offload import PrefixedDataset
from hasten.big_modeling.tensors import named_module_tensors

__all__ = ["attach_align_device_hook", "attach_align_device_hook_on_blocks", "attach_execution_device_hook"]

Device = Any


def _child(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def attach_execution_device_hook(module: nn.Module, execution_device: Device, skip_keys: str | list[str] | None = None,
                                 preload_module_classes: list[str] | None = None,
                                 tied_params_map: dict[int, dict[Any, torch.Tensor]] | None = None) -> None:
    """Give every submodule that has tensors (and no hook yet) a hook sending its inputs to ``execution_device``.

    Example:
        >>> attach_execution_device_hook(model, "cpu")
    """
    if not hasattr(module, "_hf_hook") and len(module.state_dict()) > 0:
        add_hook_to_module(module, AlignDevicesHook(execution_device, skip_keys=skip_keys,
                                                    tied_params_map=tied_params_map))
    if preload_module_classes is not None and type(module).__name__ in preload_module_classes:
        return
    for child in module.children():
        attach_execution_device_hook(child, execution_device, skip_keys=skip_keys,
                                     preload_module_classes=preload_module_classes, tied_params_map=tied_params_map)


def attach_align_device_hook(module: nn.Module, execution_device: Device = None, offload: bool = False,
                             weights_map: Mapping[str, torch.Tensor] | None = None, offload_buffers: bool = False,
                             module_name: str = "", skip_keys: str | list[str] | None = None,
                             preload_module_classes: list[str] | None = None,
                             tied_params_map: dict[int, dict[Any, torch.Tensor]] | None = None,
                             prefetcher: WeightPrefetcher | None = None) -> None:
    """Hook every submodule holding tensors directly; with ``offload`` their weights load at each forward.

    Modules of a class in ``preload_module_classes`` load all their weights at once at their own forward.

    Example:
        >>> attach_align_device_hook(model, "cpu", offload=True, weights_map=weights)
    """
    directs = list(named_module_tensors(module))
    full_offload = offload and preload_module_classes is not None and type(module).__name__ in preload_module_classes
    if directs or full_offload:
        prefixed = (PrefixedDataset(weights_map, f"{module_name}." if module_name else "")
                    if weights_map is not None else None)
        hook = AlignDevicesHook(execution_device=execution_device, offload=offload, weights_map=prefixed,
                                offload_buffers=offload_buffers, place_submodules=full_offload, skip_keys=skip_keys,
                                tied_params_map=tied_params_map, prefetcher=prefetcher if offload else None)
        add_hook_to_module(module, hook, append=True)
    if full_offload:
        return
    for name, child in module.named_children():
        attach_align_device_hook(child, execution_device=execution_device, offload=offload, weights_map=weights_map,
                                 offload_buffers=offload_buffers, module_name=_child(module_name, name),
                                 skip_keys=skip_keys, preload_module_classes=preload_module_classes,
                                 tied_params_map=tied_params_map, prefetcher=prefetcher)


def attach_align_device_hook_on_blocks(module: nn.Module, execution_device: Device | Mapping[str, Device] = None,
                                       offload: bool | Mapping[str, bool] = False,
                                       weights_map: Mapping[str, torch.Tensor] | None = None,
                                       offload_buffers: bool = False, module_name: str = "",
                                       skip_keys: str | list[str] | None = None,
                                       preload_module_classes: list[str] | None = None,
                                       tied_params_map: dict[int, dict[Any, torch.Tensor]] | None = None,
                                       prefetcher: WeightPrefetcher | None = None) -> None:
    """Hook the blocks of a device map: ``execution_device`` and ``offload`` map block names to settings.

    The root always sends its outputs back to the inputs' device.

    Example:
        >>> attach_align_device_hook_on_blocks(model, {"a": "cpu", "b": "cpu"}, {"a": False, "b": True}, weights)
    """
    if not isinstance(execution_device, Mapping) and not isinstance(offload, Mapping):
        if not offload:
            add_hook_to_module(module, AlignDevicesHook(execution_device=execution_device, io_same_device=True,
                                                        skip_keys=skip_keys, place_submodules=True,
                                                        tied_params_map=tied_params_map))
        else:
            attach_align_device_hook(module, execution_device=execution_device, offload=True, weights_map=weights_map,
                                     offload_buffers=offload_buffers, module_name=module_name, skip_keys=skip_keys,
                                     tied_params_map=tied_params_map, prefetcher=prefetcher)
        return
    if not isinstance(execution_device, Mapping):
        execution_device = {key: execution_device for key in offload}  # type: ignore[union-attr]
    if not isinstance(offload, Mapping):
        offload = {key: offload for key in execution_device}
    _hook_block(module, execution_device, offload, weights_map, offload_buffers, module_name, skip_keys,
                preload_module_classes, tied_params_map, prefetcher)
    for name, child in module.named_children():
        attach_align_device_hook_on_blocks(child, execution_device=execution_device, offload=offload,
                                           weights_map=weights_map, offload_buffers=offload_buffers,
                                           module_name=_child(module_name, name), skip_keys=skip_keys,
                                           preload_module_classes=preload_module_classes,
                                           tied_params_map=tied_params_map, prefetcher=prefetcher)


def _hook_block(module: nn.Module, execution_device: Mapping[str, Device], offload: Mapping[str, bool],
                weights_map: Any, offload_buffers: bool, name: str, skip_keys: Any, preload: Any,
                tied_params_map: Any, prefetcher: Any) -> None:
    if name in execution_device and name in offload and not offload[name]:
        hook = AlignDevicesHook(execution_device=execution_device[name], offload_buffers=offload_buffers,
                                io_same_device=(name == ""), place_submodules=True, skip_keys=skip_keys,
                                tied_params_map=tied_params_map)
        add_hook_to_module(module, hook)
        attach_execution_device_hook(module, execution_device[name], skip_keys=skip_keys,
                                     tied_params_map=tied_params_map)
    elif name in execution_device and name in offload:
        attach_align_device_hook(module, execution_device=execution_device[name], offload=True,
                                 weights_map=weights_map, offload_buffers=offload_buffers, module_name=name,
                                 skip_keys=skip_keys, preload_module_classes=preload,
                                 tied_params_map=tied_params_map, prefetcher=prefetcher)
        if not hasattr(module, "_hf_hook"):
            add_hook_to_module(module, AlignDevicesHook(execution_device=execution_device[name],
                                                        io_same_device=(name == ""), skip_keys=skip_keys,
                                                        tied_params_map=tied_params_map))
        attach_execution_device_hook(module, execution_device[name], skip_keys=skip_keys,
                                     preload_module_classes=preload, tied_params_map=tied_params_map)
    elif name == "":
        add_hook_to_module(module, AlignDevicesHook(execution_device=execution_device.get(""), io_same_device=True,
                                                    skip_keys=skip_keys, tied_params_map=tied_params_map))
