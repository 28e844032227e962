"""Forward hooks that move weights and inputs: ``ModelHook``, ``AlignDevicesHook``, ``CpuOffload``...

A hook wraps ``module.forward`` (kept in ``module._old_forward``; the hook is ``module._hf_hook``), as in
Accelerate, so code written against Accelerate and transformers' checks keep working.

Offloading hooks of one model share a :class:`WeightPrefetcher`: while a block computes, a background
thread already maps and pages in the next block's weights (the order is learned on the first forward),
so offloaded inference overlaps I/O with compute instead of loading one block at a time.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from hasten.big_modeling.tensors import (
    as_torch_device,
    get_non_persistent_buffers,
    get_submodule_and_name,
    named_module_tensors,
    set_module_tensor_to_device,
)
from hasten.ops.tree import find_device, send_to_device

__all__ = ["AlignDevicesHook", "CpuOffload", "ModelHook", "SequentialHook", "UserCpuOffloadHook",
           "WeightPrefetcher", "add_hook_to_module", "remove_hook_from_module", "remove_hook_from_submodules"]

_ADDED_ATTRIBUTES = ("to", "cuda", "npu", "xpu", "mlu", "sdaa", "musa")


class ModelHook:
    """Base hook: override ``init_hook``, ``pre_forward``, ``post_forward``, ``detach_hook``.

    Example:
        >>> class Double(ModelHook):
        ...     def post_forward(self, module, output):
        ...         return output * 2
        >>> add_hook_to_module(nn.Linear(2, 2), Double())
    """

    no_grad = False

    def init_hook(self, module: nn.Module) -> nn.Module:
        """Called when the hook is attached."""
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Called with the inputs before the forward; returns (args, kwargs)."""
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        """Called with the output after the forward; returns the output."""
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        """Called when the hook is removed."""
        return module


class SequentialHook(ModelHook):
    """Several hooks run in order (post-forwards in the same order).

    Example:
        >>> add_hook_to_module(layer, SequentialHook(HookA(), HookB()))
    """

    def __init__(self, *hooks: ModelHook) -> None:
        self.hooks = hooks

    def init_hook(self, module: nn.Module) -> nn.Module:
        for hook in self.hooks:
            module = hook.init_hook(module)
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        for hook in self.hooks:
            args, kwargs = hook.pre_forward(module, *args, **kwargs)
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        for hook in self.hooks:
            output = hook.post_forward(module, output)
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        for hook in self.hooks:
            module = hook.detach_hook(module)
        return module


def _hooked_forward(module: Any, *args: Any, **kwargs: Any) -> Any:
    hook = module._hf_hook
    args, kwargs = hook.pre_forward(module, *args, **kwargs)
    if hook.no_grad:
        with torch.no_grad():
            output = module._old_forward(*args, **kwargs)
    else:
        output = module._old_forward(*args, **kwargs)
    return hook.post_forward(module, output)


def add_hook_to_module(module: nn.Module, hook: ModelHook, append: bool = False) -> nn.Module:
    """Attach ``hook`` to ``module`` (replacing an existing hook unless ``append``, which chains them).

    Example:
        >>> add_hook_to_module(model, AlignDevicesHook(execution_device="cpu", io_same_device=True))
    """
    target: Any = module  # the attributes hasten adds are not nn.Module's typed ones
    if append and getattr(target, "_hf_hook", None) is not None:
        old_hook = target._hf_hook
        remove_hook_from_module(module)
        hook = SequentialHook(old_hook, hook)
    if hasattr(target, "_hf_hook") and hasattr(target, "_old_forward"):
        old_forward = target._old_forward
    else:
        old_forward = target.forward
        target._old_forward = old_forward
    target = hook.init_hook(target)
    target._hf_hook = hook
    new_forward = functools.update_wrapper(functools.partial(_hooked_forward, target), old_forward)
    if "GraphModuleImpl" in str(type(target)):  # fx graph modules regenerate forward on the class
        target.__class__.forward = new_forward
    else:
        target.forward = new_forward
    return target


def remove_hook_from_module(module: nn.Module, recurse: bool = False) -> nn.Module:
    """Detach the hook of ``module`` (and of its submodules with ``recurse``), restoring its forward.

    Example:
        >>> remove_hook_from_module(model, recurse=True)
    """
    target: Any = module  # the attributes hasten adds are not nn.Module's typed ones
    if hasattr(target, "_hf_hook"):
        target._hf_hook.detach_hook(target)
        delattr(target, "_hf_hook")
    if hasattr(target, "_old_forward"):
        if "GraphModuleImpl" in str(type(target)):
            target.__class__.forward = target._old_forward
        else:
            target.forward = target._old_forward
        delattr(target, "_old_forward")
    for attr in _ADDED_ATTRIBUTES:  # the warn-on-move wrappers dispatch_model installs
        module.__dict__.pop(attr, None)
    if recurse:
        for child in module.children():
            remove_hook_from_module(child, recurse)
    return module


def remove_hook_from_submodules(module: nn.Module) -> None:
    """Remove the hooks of ``module`` and all its submodules.

    Example:
        >>> remove_hook_from_submodules(model)
    """
    remove_hook_from_module(module)
    for child in module.children():
        remove_hook_from_submodules(child)


_EXECUTOR: tuple[int, ThreadPoolExecutor] | None = None


def _executor() -> ThreadPoolExecutor:
    """One shared I/O thread per process (recreated after a fork, where the parent's thread does not exist)."""
    global _EXECUTOR
    if _EXECUTOR is None or _EXECUTOR[0] != os.getpid():
        _EXECUTOR = (os.getpid(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="hasten-prefetch"))
    return _EXECUTOR[1]


def _page_in(tensor: torch.Tensor) -> None:
    """Touch one byte per page so a memory-mapped tensor is read from disk now, off the compute thread."""
    if tensor.device.type != "cpu" or tensor.numel() == 0 or not tensor.is_contiguous():
        return
    raw = tensor.reshape(-1).view(torch.uint8) if tensor.element_size() > 0 else None
    if raw is not None and raw.numel() > 4096:
        raw[::4096].sum()


class WeightPrefetcher:
    """Reads the next offloaded block's weights in a background thread while the current one computes.

    The successor of each hook is learned from the order of forwards; a wrong guess (the model took
    another path) is simply discarded, so results never depend on the prediction.

    Example:
        >>> prefetcher = WeightPrefetcher()
        >>> hook = AlignDevicesHook("cpu", offload=True, weights_map=weights, prefetcher=prefetcher)
    """

    def __init__(self) -> None:
        self.successor: dict[int, AlignDevicesHook] = {}
        self.last: AlignDevicesHook | None = None
        self.pending: tuple[AlignDevicesHook, Future[dict[str, torch.Tensor]]] | None = None

    @staticmethod
    def _read(hook: AlignDevicesHook) -> dict[str, torch.Tensor]:
        values = hook.read_weights()
        for value in values.values():
            _page_in(value)
        return values

    def fetch(self, hook: AlignDevicesHook) -> dict[str, torch.Tensor]:
        """The weights of ``hook``'s module (prefetched if predicted), then start reading the next ones."""
        pending, self.pending = self.pending, None
        if pending is not None and pending[0] is hook:
            values = pending[1].result()
        else:
            values = hook.read_weights()
        if self.last is not None and self.last is not hook:
            self.successor[id(self.last)] = hook
        self.last = hook
        upcoming = self.successor.get(id(hook))
        if upcoming is not None:
            self.pending = (upcoming, _executor().submit(self._read, upcoming))
        return values


class AlignDevicesHook(ModelHook):
    """Run a module on ``execution_device``: move (or, with ``offload``, load) its weights and its inputs there.

    Args:
        execution_device: where the forward runs.
        offload: keep the weights on ``meta`` between forwards and load them from ``weights_map`` each time.
        io_same_device: send the outputs back to the device of the inputs.
        weights_map: name -> tensor mapping holding the offloaded weights (CPU copies by default).
        offload_buffers: offload the buffers too.
        place_submodules: handle the submodules' tensors as well.
        skip_keys: input dict keys left where they are.
        tied_params_map: ``{data_ptr: {device: tensor}}`` shared by the hooks of one model, so tied weights
            are materialized once per device.
        prefetcher: a shared :class:`WeightPrefetcher` (hasten addition; ``None`` loads on demand).

    Example:
        >>> add_hook_to_module(layer, AlignDevicesHook(execution_device="cpu", offload=True))
    """

    def __init__(self, execution_device: int | str | torch.device | None = None, offload: bool = False,
                 io_same_device: bool = False, weights_map: Mapping[str, torch.Tensor] | None = None,
                 offload_buffers: bool = False, place_submodules: bool = False,
                 skip_keys: str | list[str] | None = None,
                 tied_params_map: dict[int, dict[Any, torch.Tensor]] | None = None,
                 prefetcher: WeightPrefetcher | None = None) -> None:
        self.execution_device = execution_device
        self.offload = offload
        self.io_same_device = io_same_device
        self.weights_map = weights_map
        self.offload_buffers = offload_buffers
        self.place_submodules = place_submodules
        self.skip_keys = skip_keys
        self.input_device: torch.device | None = None
        self.param_original_devices: dict[str, torch.device] = {}
        self.buffer_original_devices: dict[str, torch.device] = {}
        self.tied_params_names: set[str] = set()
        self.tied_params_map = tied_params_map
        self.prefetcher = prefetcher
        self.original_devices: dict[str, torch.device] = {}
        self._offloaded_names: list[str] = []
        self.tied_pointers_to_remove: set[tuple[int, Any]] = set()

    def __repr__(self) -> str:
        return (f"AlignDevicesHook(execution_device={self.execution_device}, offload={self.offload}, "
                f"io_same_device={self.io_same_device}, offload_buffers={self.offload_buffers}, "
                f"place_submodules={self.place_submodules}, skip_keys={self.skip_keys!r})")

    def _tensors(self, module: nn.Module, offloaded_only: bool = False) -> list[tuple[str, torch.Tensor]]:
        return list(named_module_tensors(module, include_buffers=self.offload_buffers if offloaded_only else True,
                                         recurse=self.place_submodules, remove_non_persistent=offloaded_only))

    def init_hook(self, module: nn.Module) -> nn.Module:
        if str(self.execution_device) == "meta":
            self.tied_params_map = None  # data_ptr() of meta tensors is always 0
        if not self.offload and self.execution_device is not None:
            for name, _ in self._tensors(module):
                set_module_tensor_to_device(module, name, self.execution_device, tied_params_map=self.tied_params_map)
        elif self.offload:
            self.original_devices = {name: t.device for name, t in self._tensors(module)}
            if self.weights_map is None:
                self.weights_map = {name: t.to("cpu") for name, t in named_module_tensors(
                    module, include_buffers=self.offload_buffers, recurse=self.place_submodules)}
            self._offloaded_names = [name for name, _ in self._tensors(module, offloaded_only=True)]
            for name in self._offloaded_names:
                owner, leaf = get_submodule_and_name(module, name)
                if self.tied_params_map is not None and getattr(owner, leaf).data_ptr() in self.tied_params_map:
                    self.tied_params_names.add(name)
                set_module_tensor_to_device(module, name, "meta")
            if self.execution_device is not None:
                names = ([n for n, _ in module.named_buffers(recurse=self.place_submodules)] if not self.offload_buffers
                         else sorted(get_non_persistent_buffers(module, recurse=self.place_submodules, fqns=True)))
                for name in names:
                    set_module_tensor_to_device(module, name, self.execution_device,
                                                tied_params_map=self.tied_params_map)
        return module

    def read_weights(self) -> dict[str, torch.Tensor]:
        """This module's offloaded tensors, read from ``weights_map`` (safe to call from the prefetch thread)."""
        assert self.weights_map is not None
        return {name: self.weights_map[name] for name in self._offloaded_names}

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.io_same_device:
            self.input_device = find_device([args, kwargs])
        if self.offload:
            values = self.prefetcher.fetch(self) if self.prefetcher is not None else self.read_weights()
            device_key = as_torch_device(self.execution_device)  # type: ignore[arg-type]  # set when offloading
            self.tied_pointers_to_remove = set()
            for name, value in values.items():
                ptr = value.data_ptr()
                if self.tied_params_map is not None:
                    if name in self.tied_params_names and ptr not in self.tied_params_map:
                        self.tied_params_map[ptr] = {}
                    if ptr in self.tied_params_map and device_key not in self.tied_params_map[ptr]:
                        self.tied_pointers_to_remove.add((ptr, device_key))
                set_module_tensor_to_device(module, name, device_key, value=value,
                                            tied_params_map=self.tied_params_map)
        if self.execution_device is None:  # a pure io_same_device hook: inputs stay where they are
            return args, kwargs
        return (send_to_device(args, self.execution_device),
                send_to_device(kwargs, self.execution_device, skip_keys=self.skip_keys))

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        if self.offload:
            for name in self._offloaded_names:
                set_module_tensor_to_device(module, name, "meta")
            for ptr, device in self.tied_pointers_to_remove:
                self.tied_params_map[ptr].pop(device, None)  # type: ignore[index]
            self.tied_pointers_to_remove = set()
        if self.io_same_device and self.input_device is not None:
            output = send_to_device(output, self.input_device, skip_keys=self.skip_keys)
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        if self.offload and self.weights_map is not None:
            for name, device in self.original_devices.items():
                if device.type != "meta":
                    value = self.weights_map[name] if name in self.weights_map else None
                    set_module_tensor_to_device(module, name, device, value=value)
        return module


class CpuOffload(ModelHook):
    """Keep the whole module on the CPU and move it to ``execution_device`` at its forward.

    ``prev_module_hook`` (a :class:`UserCpuOffloadHook`) is offloaded back first, which chains pipelines.

    Example:
        >>> add_hook_to_module(model, CpuOffload(execution_device="cuda:0"))
    """

    def __init__(self, execution_device: int | str | torch.device | None = None,
                 prev_module_hook: UserCpuOffloadHook | None = None) -> None:
        self.prev_module_hook = prev_module_hook
        if execution_device is None:
            execution_device = "cuda:0" if torch.cuda.is_available() else "cpu"
        self.execution_device = execution_device

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module.to("cpu")

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.prev_module_hook is not None:
            self.prev_module_hook.offload()
        module.to(self.execution_device)
        return send_to_device(args, self.execution_device), send_to_device(kwargs, self.execution_device)


class UserCpuOffloadHook:
    """The handle ``cpu_offload_with_hook`` returns: ``offload()`` moves the model back to the CPU.

    Example:
        >>> model, hook = cpu_offload_with_hook(model, "cuda:0")
        >>> hook.offload()
    """

    def __init__(self, model: nn.Module, hook: CpuOffload) -> None:
        self.model = model
        self.hook = hook

    def offload(self) -> None:
        """Move the model back to the CPU."""
        self.hook.init_hook(self.model)

    def remove(self) -> None:
        """Remove the hook from the model."""
        remove_hook_from_module(self.model)
