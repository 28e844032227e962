"""Smaller big-model helpers of Accelerate: layerwise casting, temporary device alignment, tied-weight checks."""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from hasten.base import constants
from hasten.big_modeling.hooks import AlignDevicesHook, ModelHook, add_hook_to_module
from hasten.big_modeling.tensors import find_tied_parameters, retie_parameters, set_module_tensor_to_device

#: Layers whose weights ``attach_layerwise_casting_hooks`` stores in a low-precision dtype (one tuple, defined
#: in hasten.base.constants as Accelerate's in accelerate.utils.constants, so both paths show the same object).
SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING = constants.SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING
_DEFAULT_SKIP_PATTERNS = ("pos_embed", "patch_embed", "norm", "^proj_in$", "^proj_out$")


class LayerwiseCastingHook(ModelHook):
    """Store a layer's weights in ``storage_dtype`` (e.g. ``torch.float8_e4m3fn``) and upcast them to
    ``compute_dtype`` only for its forward, halving (or quartering) the memory the weights take at rest."""

    _is_stateful = False

    def __init__(self, storage_dtype: torch.dtype, compute_dtype: torch.dtype, non_blocking: bool) -> None:
        self.storage_dtype = storage_dtype
        self.compute_dtype = compute_dtype
        self.non_blocking = non_blocking

    def init_hook(self, module: nn.Module) -> nn.Module:
        """Cast the weights to the storage dtype."""
        return module.to(dtype=self.storage_dtype, non_blocking=self.non_blocking)

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Upcast the weights for the forward."""
        module.to(dtype=self.compute_dtype, non_blocking=self.non_blocking)
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        """Cast the weights back down after the forward."""
        module.to(dtype=self.storage_dtype, non_blocking=self.non_blocking)
        return output


def attach_layerwise_casting_hooks(module: nn.Module, storage_dtype: torch.dtype, compute_dtype: torch.dtype,
                                   skip_modules_pattern: str | tuple[str, ...] | None = "auto",
                                   skip_modules_classes: tuple[type[nn.Module], ...] | None = None,
                                   non_blocking: bool = False) -> None:
    """Attach a :class:`LayerwiseCastingHook` to every linear/convolution layer not skipped.

    ``skip_modules_pattern="auto"`` skips embeddings, norms and input/output projections, which lose
    too much accuracy in low precision.
    """
    patterns = _DEFAULT_SKIP_PATTERNS if skip_modules_pattern == "auto" else (
        (skip_modules_pattern,) if isinstance(skip_modules_pattern, str) else tuple(skip_modules_pattern or ()))
    skip_classes = tuple(skip_modules_classes or ())

    def visit(current: nn.Module, name: str) -> None:
        if (patterns and any(re.search(p, name) for p in patterns)) or (skip_classes and isinstance(current,
                                                                                                    skip_classes)):
            return
        if isinstance(current, SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING):
            add_hook_to_module(current, LayerwiseCastingHook(storage_dtype, compute_dtype, non_blocking), append=True)
            return
        for child_name, child in current.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name)

    visit(module, "")


@contextlib.contextmanager
def align_module_device(module: nn.Module, execution_device: torch.device | str | None = None) -> Iterator[None]:
    """Inside the block, the module's parameters are real tensors on ``execution_device`` (offloaded ones
    are loaded); afterwards everything is back where it was.

    Example:
        >>> with align_module_device(offloaded_layer, "cpu"):
        ...     print(offloaded_layer.weight.sum())
    """
    hook = getattr(module, "_hf_hook", None)
    if isinstance(hook, AlignDevicesHook) and hook.offload:
        device = hook.execution_device
        if execution_device is not None:
            hook.execution_device = execution_device
        try:
            hook.pre_forward(module)
            yield
        finally:
            hook.post_forward(module, None)
            hook.execution_device = device
        return
    if execution_device is None:
        yield
        return
    originals = {name: param.device for name, param in module.named_parameters(recurse=False)}
    try:
        for name in originals:
            set_module_tensor_to_device(module, name, execution_device)
        yield
    finally:
        for name, device in originals.items():
            set_module_tensor_to_device(module, name, device)


def check_tied_parameters_on_same_device(tied_params: list[list[str]], device_map: Mapping[str, Any]) -> None:
    """Warn when a device map puts the members of one tied group on different devices (they would be copied)."""
    def device_of(name: str) -> Any:
        best = ""
        for key in device_map:
            if (key == "" or name == key or name.startswith(key + ".")) and len(key) >= len(best):
                best = key
        return device_map.get(best)

    for group in tied_params:
        devices = {str(device_of(name)) for name in group}
        if len(devices) > 1:
            warnings.warn(f"Tied parameters are on different devices: {dict((n, device_of(n)) for n in group)}. "
                          "Put them on one device in the device map.", stacklevel=2)


def ensure_weights_retied(param_init_fn: Callable[[nn.Module], Any], model: nn.Module,
                          device: torch.device) -> Callable[[nn.Module], Any]:
    """Wrap an FSDP ``param_init_fn`` so that tied weights are tied again after it materializes them."""
    tied = find_tied_parameters(model)
    if not tied:
        return param_init_fn

    def init_and_retie(module: nn.Module) -> Any:
        result = param_init_fn(module)
        retie_parameters(model, tied)
        return result

    return init_and_retie


def get_state_dict_offloaded_model(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict (on CPU) of a model whose weights are offloaded to CPU or disk by hooks."""
    state: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        if not own:
            continue
        with align_module_device(module, "cpu"):
            for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                state[f"{prefix}.{name}" if prefix else name] = tensor.detach().to("cpu").clone()
    return state
