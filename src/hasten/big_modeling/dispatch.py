"""Run a model spread over devices: ``dispatch_model``, ``load_checkpoint_and_dispatch``, CPU/disk offload."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from hasten._private_api import to_call_device
from hasten.big_modeling.attach import attach_align_device_hook, attach_align_device_hook_on_blocks
from hasten.big_modeling.device_map import _walk_device_map, check_device_map
from hasten.big_modeling.hooks import (
    AlignDevicesHook,
    CpuOffload,
    UserCpuOffloadHook,
    WeightPrefetcher,
    add_hook_to_module,
)
from hasten.big_modeling.loading import load_checkpoint_in_model
from hasten.big_modeling.offload import (
    AliasedWeights,
    OffloadedWeightsLoader,
    extract_submodules_state_dict,
    offload_state_dict,
)
from hasten.big_modeling.sizes import (
    compute_module_sizes,
    get_balanced_memory,
    get_max_layer_size,
    get_max_memory,
)
from hasten.big_modeling.tensors import (
    as_torch_device,
    find_tied_parameters,
    get_submodule_and_name,
    retie_parameters,
)

logger = logging.getLogger(__name__)

__all__ = ["cpu_offload", "cpu_offload_with_hook", "disk_offload", "dispatch_model", "load_checkpoint_and_dispatch"]

DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
_MOVE_WARNING = "You shouldn't move a model that is dispatched using hasten (Accelerate) hooks."


def _first_device(model: nn.Module) -> torch.device:
    return next(iter(model.parameters())).device


def cpu_offload(model: nn.Module, execution_device: int | str | torch.device | None = None,
                offload_buffers: bool = False, state_dict: Mapping[str, torch.Tensor] | None = None,
                preload_module_classes: list[str] | None = None) -> nn.Module:
    """Keep every weight in CPU RAM and load each module's weights onto ``execution_device`` at its forward.

    Example:
        >>> model = cpu_offload(model, execution_device="cuda:0")
    """
    if execution_device is None:
        execution_device = _first_device(model)
    if state_dict is None:
        state_dict = {name: tensor.to("cpu") for name, tensor in model.state_dict().items()}
    add_hook_to_module(model, AlignDevicesHook(io_same_device=True), append=True)
    attach_align_device_hook(model, execution_device=execution_device, offload=True, offload_buffers=offload_buffers,
                             weights_map=state_dict, preload_module_classes=preload_module_classes,
                             prefetcher=WeightPrefetcher())
    return model


def cpu_offload_with_hook(model: nn.Module, execution_device: int | str | torch.device | None = None,
                          prev_module_hook: UserCpuOffloadHook | None = None) -> tuple[nn.Module, UserCpuOffloadHook]:
    """Move the whole model to ``execution_device`` when it runs; the returned hook's ``offload()`` moves it back.

    Example:
        >>> model_1, hook_1 = cpu_offload_with_hook(model_1, "cuda:0")
        >>> model_2, hook_2 = cpu_offload_with_hook(model_2, "cuda:0", prev_module_hook=hook_1)
    """
    hook = CpuOffload(execution_device=execution_device, prev_module_hook=prev_module_hook)
    add_hook_to_module(model, hook, append=True)
    return model, UserCpuOffloadHook(model, hook)


def disk_offload(model: nn.Module, offload_dir: str | os.PathLike[str],
                 execution_device: int | str | torch.device | None = None, offload_buffers: bool = False,
                 preload_module_classes: list[str] | None = None) -> nn.Module:
    """Write the weights to ``offload_dir`` (unless it already holds an ``index.json``) and load them per module.

    The next module's weights are prefetched in the background while the current one computes.

    Example:
        >>> model = disk_offload(model, "offload", execution_device="cpu")
    """
    if not os.path.isfile(os.path.join(offload_dir, "index.json")):
        offload_state_dict(offload_dir, model.state_dict())
    if execution_device is None:
        execution_device = _first_device(model)
    weights_map = OffloadedWeightsLoader(save_folder=offload_dir)
    add_hook_to_module(model, AlignDevicesHook(io_same_device=True), append=True)
    attach_align_device_hook(model, execution_device=execution_device, offload=True, offload_buffers=offload_buffers,
                             weights_map=weights_map, preload_module_classes=preload_module_classes,
                             prefetcher=WeightPrefetcher())
    return model


def _with_tied_aliases(model: nn.Module, weights_map: Mapping[str, torch.Tensor],
                       tied: list[list[str]]) -> Mapping[str, torch.Tensor]:
    """Let tied names absent from ``weights_map`` read their twin (checkpoints store a tied weight once)."""
    aliases: dict[str, str] = {}
    extra: dict[str, torch.Tensor] = {}
    for group in tied:
        present = [n for n in group if n in weights_map]
        for name in group:
            if name in weights_map:
                continue
            if present:
                aliases[name] = present[0]
                continue
            for twin in group:
                owner, leaf = get_submodule_and_name(model, twin)
                if getattr(owner, leaf).device.type != "meta":
                    extra[name] = getattr(owner, leaf)
                    break
    if not aliases and not extra:
        return weights_map
    if extra:
        aliases.update({name: f"\x00tied:{name}" for name in extra})
        base: Mapping[str, torch.Tensor] = _Chain(weights_map, {f"\x00tied:{n}": t for n, t in extra.items()})
    else:
        base = weights_map
    return AliasedWeights(base, aliases)


class _Chain(Mapping):  # type: ignore[type-arg]
    def __init__(self, first: Mapping[str, Any], second: Mapping[str, Any]) -> None:
        self.first, self.second = first, second

    def __getitem__(self, key: str) -> Any:
        return self.first[key] if key in self.first else self.second[key]

    def __iter__(self) -> Any:
        return iter(list(self.first) + list(self.second))

    def __len__(self) -> int:
        return len(self.first) + len(self.second)

    def __contains__(self, key: object) -> bool:
        return key in self.first or key in self.second


def _warn_on_move(fn: Callable[..., Any], model: nn.Module) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if fn.__name__ != "to" or to_call_device(*args, **kwargs) is not None:
            logger.warning(_MOVE_WARNING)
        if any(p.device.type == "meta" for p in model.parameters()):
            raise RuntimeError("You can't move a model that has some modules offloaded to cpu or disk: remove the "
                               "hooks first (remove_hook_from_submodules) or dispatch it again with another map.")
        return fn(*args, **kwargs)

    return wrapper


def _main_device(device_map: Mapping[str, Any]) -> Any:
    values = {str(v) for v in device_map.values()}
    if values <= {"cpu", "disk"}:
        return "cpu"
    return next(d for d in device_map.values() if str(d) not in ("cpu", "disk"))


def dispatch_model(model: nn.Module, device_map: Mapping[str, int | str | torch.device],
                   main_device: int | str | torch.device | None = None,
                   state_dict: Mapping[str, torch.Tensor] | None = None,
                   offload_dir: str | os.PathLike[str] | None = None, offload_index: Mapping[str, Any] | None = None,
                   offload_buffers: bool = False, skip_keys: str | list[str] | None = None,
                   preload_module_classes: list[str] | None = None, force_hooks: bool = False) -> nn.Module:
    """Place ``model``'s modules per ``device_map`` and hook them so a forward runs across devices.

    CPU modules run on the main device (first GPU) by loading their weights from RAM at each forward (or
    in place when there is no GPU); ``"disk"`` modules load theirs from ``offload_dir`` (prefetched). The
    outputs come back on the inputs' device. Sets ``model.hf_device_map``.

    Example:
        >>> model = dispatch_model(model, {"block1": "cpu", "block2": "disk"}, offload_dir="offload")
    """
    check_device_map(model, device_map)
    values = [str(v) for v in device_map.values()]
    if len(set(values)) > 1 or force_hooks or "disk" in values:
        _dispatch_with_hooks(model, device_map, main_device, state_dict, offload_dir, offload_index,
                             offload_buffers, skip_keys, preload_module_classes)
    else:
        device = next(iter(device_map.values()))
        if str(device) == "disk":
            raise ValueError("The device_map puts the whole model on the disk: use `disk_offload(model, offload_dir)` "
                             "instead.")
        target = as_torch_device(device)
        if not _all_on(model, target):  # a loaded model is usually there already: skip a walk over every module
            model.to(target)
    setattr(model, "hf_device_map", dict(device_map))  # noqa: B010 - nn.Module's typed __setattr__
    return model


def _all_on(model: nn.Module, device: torch.device) -> bool:
    """True when every parameter and buffer of ``model`` already sits on ``device`` (``model.to`` is a no-op)."""
    return all(t.device == device for t in model.parameters()) and all(t.device == device for t in model.buffers())


def _dispatch_with_hooks(model: nn.Module, device_map: Mapping[str, Any], main_device: Any, state_dict: Any,
                         offload_dir: Any, offload_index: Any, offload_buffers: bool, skip_keys: Any,
                         preload_module_classes: Any) -> None:
    if main_device is None:
        main_device = _main_device(device_map)
    disk_modules = [name for name, device in device_map.items() if str(device) == "disk"]
    if str(main_device) != "cpu":
        cpu_modules = [name for name, device in device_map.items() if str(device) == "cpu"]
        if state_dict is None and cpu_modules:
            state_dict = extract_submodules_state_dict(model.state_dict(), cpu_modules)
    if disk_modules and offload_dir is None and offload_index is None:
        raise ValueError(f"The device_map puts {', '.join(disk_modules)} on 'disk' but no `offload_dir` was given. "
                         "HINT: pass offload_dir='some/folder'.")
    if disk_modules and offload_index is None and not os.path.isfile(os.path.join(offload_dir, "index.json")):
        offload_state_dict(offload_dir, extract_submodules_state_dict(model.state_dict(), disk_modules))
    execution_device = {name: main_device if str(device) in ("cpu", "disk") else device
                        for name, device in device_map.items()}
    execution_device[""] = main_device
    offloaded = ["disk"] if str(main_device) in ("cpu", "mps") else ["cpu", "disk"]
    offload = {name: str(device) in offloaded for name, device in device_map.items()}
    save_folder = offload_dir if disk_modules else None
    tied = find_tied_parameters(model)
    weights_map: Mapping[str, torch.Tensor] | None = None
    tied_params_map: dict[int, dict[Any, torch.Tensor]] = {}
    if state_dict is not None or save_folder is not None or offload_index is not None:
        weights_map = OffloadedWeightsLoader(state_dict=dict(state_dict or {}), save_folder=save_folder,
                                             index=offload_index)
        weights_map = _with_tied_aliases(model, weights_map, tied)
        for group in tied:  # in-RAM tied weights keep a stable pointer: share one copy per device
            for name in group:
                if weights_map is not None and name in weights_map and name in (state_dict or {}):
                    tied_params_map[weights_map[name].data_ptr()] = {}
    attach_align_device_hook_on_blocks(model, execution_device=execution_device, offload=offload,
                                       offload_buffers=offload_buffers, weights_map=weights_map, skip_keys=skip_keys,
                                       preload_module_classes=preload_module_classes, tied_params_map=tied_params_map,
                                       prefetcher=WeightPrefetcher())
    offloaded_to = sorted({v for v in map(str, device_map.values()) if v in ("cpu", "disk")} & set(offloaded))
    if offloaded_to:
        logger.warning("Some parameters are on the meta device because they were offloaded to the %s.",
                       " and ".join(offloaded_to))
    retie_parameters(model, tied)
    for attr in ("to", "cuda"):
        setattr(model, attr, _warn_on_move(getattr(model, attr), model))


def _auto_device_map(model: nn.Module, device_map: str, max_memory: Any, no_split_module_classes: Any, dtype: Any,
                     offload_buffers: bool) -> dict[str, Any]:
    if device_map not in DEVICE_MAP_STRATEGIES:
        raise ValueError(f"device_map={device_map!r} is not a known strategy: use one of "
                         f"{', '.join(map(repr, DEVICE_MAP_STRATEGIES))}, or a dict of module name -> device.")
    if device_map != "sequential":
        max_memory = get_balanced_memory(model, max_memory=max_memory, no_split_module_classes=no_split_module_classes,
                                         dtype=dtype, low_zero=(device_map == "balanced_low_0"))
    budget = get_max_memory(max_memory)
    sizes = compute_module_sizes(model, dtype=dtype)  # once, for the check and the walk
    _check_room_for_largest_layer(model, budget, no_split_module_classes, sizes)
    return _walk_device_map(model, budget, no_split_module_classes, dtype, None, offload_buffers=offload_buffers,
                            sizes=sizes)


def _check_room_for_largest_layer(model: nn.Module, budget: Mapping[Any, int], no_split: Any,
                                  sizes: Mapping[str, int]) -> None:
    """Every layer must fit on the main device to run: say how much is needed when it cannot."""
    gpus = [d for d in budget if isinstance(d, int) and budget[d] > 0]
    main = gpus[0] if gpus else ("mps" if "mps" in budget else "cpu")
    if main not in budget:
        return
    no_split = [no_split] if isinstance(no_split, str) else list(no_split or [])
    largest, names = get_max_layer_size(list(model.named_children()) or [("", model)], sizes, no_split)
    if budget[main] < largest:
        raise ValueError(f"max_memory[{main!r}] = {budget[main]} bytes cannot hold the largest layer "
                         f"({', '.join(names)}: {int(largest)} bytes), which must fit on the main device to run. "
                         f"HINT: give {main!r} at least {int(largest)} bytes (plus room for what stays there).")


def load_checkpoint_and_dispatch(model: nn.Module, checkpoint: str | os.PathLike[str],
                                 device_map: str | Mapping[str, Any] | None = None, max_memory: Any = None,
                                 no_split_module_classes: list[str] | None = None,
                                 offload_folder: str | os.PathLike[str] | None = None, offload_buffers: bool = False,
                                 dtype: str | torch.dtype | None = None, offload_state_dict: bool | None = None,
                                 skip_keys: str | list[str] | None = None,
                                 preload_module_classes: list[str] | None = None, force_hooks: bool = False,
                                 strict: bool = False, full_state_dict: bool = True,
                                 broadcast_from_rank0: bool = False) -> nn.Module:
    """Load ``checkpoint`` into ``model`` (usually built with ``init_empty_weights``) and dispatch it.

    ``device_map`` is a dict or one of ``"auto"``/``"balanced"``/``"balanced_low_0"``/``"sequential"``
    (computed with ``max_memory``). Disk-mapped weights of safetensors checkpoints are read in place.

    Example:
        >>> with init_empty_weights():
        ...     model = MyModel()
        >>> model = load_checkpoint_and_dispatch(model, "ckpt/", device_map="auto", max_memory={"cpu": "2GB"},
        ...                                      no_split_module_classes=["Block"], offload_folder="offload")
    """
    if isinstance(device_map, str):
        device_map = _auto_device_map(model, device_map, max_memory, no_split_module_classes, dtype,
                                      offload_buffers)
        if "disk" in map(str, device_map.values()) and offload_folder is None:
            raise ValueError("The model does not fit in `max_memory`, so part of it must go to disk, but no "
                             "`offload_folder` was given. HINT: pass offload_folder='some/folder' or raise "
                             "max_memory.")
    if offload_state_dict is None and device_map is not None and "disk" in map(str, device_map.values()):
        offload_state_dict = True
    load_checkpoint_in_model(model, checkpoint, device_map=device_map, offload_folder=offload_folder, dtype=dtype,
                             offload_state_dict=bool(offload_state_dict), offload_buffers=offload_buffers,
                             strict=strict, full_state_dict=full_state_dict, broadcast_from_rank0=broadcast_from_rank0)
    if device_map is None:
        return model
    _check_nothing_left_on_meta(model, device_map, offload_buffers, checkpoint)
    return dispatch_model(model, device_map=device_map, offload_dir=offload_folder, offload_buffers=offload_buffers,
                          skip_keys=skip_keys, preload_module_classes=preload_module_classes, force_hooks=force_hooks)


def _check_nothing_left_on_meta(model: nn.Module, device_map: Mapping[str, Any], offload_buffers: bool,
                                checkpoint: Any) -> None:
    from hasten.big_modeling.loading import _device_for

    tied = {n for group in find_tied_parameters(model) for n in group}
    left = [name for name, tensor in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers())
            if tensor.device.type == "meta" and str(_device_for(name, device_map)) != "disk" and name not in tied]
    if left:
        raise ValueError(f"These weights were not found in the checkpoint {os.fspath(checkpoint)!r} and are still "
                         f"empty: {', '.join(left[:20])}. HINT: check that the checkpoint matches the model.")
