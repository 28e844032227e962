"""Model helpers that Accelerate exports from ``accelerate.utils``: unwrapping, regional compilation,
layer inspection, small dictionary and formatting helpers.

Bottom layer: torch only. Optional packages (deepspeed, torchao, bitsandbytes, Transformer Engine) are
recognised by their classes' module names, so asking never imports them.
"""

from __future__ import annotations

import functools
import logging
import platform
import sys
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch import nn

from hasten._lazy import accelerate_path_getattr
from hasten.base.imports import is_compiled_module, is_torchao_available
from hasten.exceptions import MissingDependencyError


def _torch_safe_globals() -> list[Any]:
    import codecs

    import numpy as np  # already imported by torch

    core = getattr(np, "_core", None) or np.core
    found: list[Any] = [core.multiarray._reconstruct, np.ndarray, codecs.encode, np.dtype]
    if hasattr(np, "dtypes"):
        found.append(np.dtypes.UInt32DType)
    return found


#: The globals a ``weights_only`` torch load of numpy arrays and RNG states needs (Accelerate's list).
TORCH_SAFE_GLOBALS: list[Any] = _torch_safe_globals()


def recursive_getattr(obj: Any, attr: str) -> Any:
    """``getattr`` along a dotted path: ``recursive_getattr(model, "encoder.layer.0")``."""
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def merge_dicts(source: dict[str, Any], destination: dict[str, Any]) -> dict[str, Any]:
    """Merge ``source`` into ``destination`` recursively (nested dicts are merged, other values replaced)."""
    for key, value in source.items():
        if isinstance(value, dict):
            merge_dicts(value, destination.setdefault(key, {}))
        else:
            destination[key] = value
    return destination


def convert_bytes(size: float) -> str:
    """A byte count for people: ``convert_bytes(3 * 2**30) == "3.0 GB"``."""
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if size < 1024.0:
            return f"{round(size, 2)} {unit}"
        size /= 1024.0
    return f"{round(size, 2)} PB"


def get_pretty_name(obj: Any) -> str:
    """The readable name of a class, function or object."""
    if not hasattr(obj, "__qualname__") and not hasattr(obj, "__name__"):
        obj = getattr(obj, "__class__", obj)
    return str(getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or obj)


def are_libraries_initialized(*library_names: str) -> list[str]:
    """The given libraries that are already imported (``notebook_launcher`` refuses to fork after CUDA ones)."""
    return [name for name in library_names if name in sys.modules]


def check_os_kernel() -> None:
    """Warn on Linux kernels older than 5.5, where processes can hang (as Accelerate does)."""
    info = platform.uname()
    if info.system != "Linux":
        return
    release = info.release.split("-")[0]
    try:
        version = tuple(int(p) for p in release.split(".")[:2])
    except ValueError:
        return
    if version < (5, 5):
        logging.getLogger(__name__).warning(  # a log record, as Accelerate's
            f"Detected kernel version {release}, which is below the recommended minimum of 5.5.0; this can cause "
            "the process to hang. It is recommended to upgrade the kernel.")


def clean_state_dict_for_safetensors(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Drop the second and later names of tensors that share storage, and make tensors contiguous.

    safetensors refuses shared tensors; the dropped names are re-tied when the model is loaded.
    """
    seen: set[tuple[torch.device, int, int | torch.SymInt]] = set()
    clean: dict[str, Any] = {}
    for name, value in state_dict.items():
        if isinstance(value, torch.Tensor):
            key = (value.device, value.untyped_storage().data_ptr(), value.storage_offset())
            if value.device.type != "meta" and key in seen:
                continue
            seen.add(key)
            value = value.contiguous()
        clean[name] = value
    return clean


def extract_model_from_parallel(model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True,
                                recursive: bool = False) -> nn.Module:
    """Remove DDP/DataParallel/DeepSpeed wrappers (and optionally ``torch.compile`` and fp32-output wrappers).

    Example:
        >>> plain = extract_model_from_parallel(accelerator.prepare(model))
    """
    compiled = None
    if is_compiled_module(model):
        compiled, model = model, model._orig_mod
    while isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)) or \
            type(model).__name__ in ("DeepSpeedEngine", "PipelineEngine"):
        # DDP, DataParallel and DeepSpeed's engines hold the wrapped model in `.module`
        model = cast(nn.Module, model.module)
    if recursive:
        for name, child in list(model.named_children()):
            setattr(model, name, extract_model_from_parallel(child, keep_fp32_wrapper, keep_torch_compile, True))
    if not keep_fp32_wrapper and "forward" in model.__dict__:
        original = getattr(model.__dict__["forward"], "__wrapped__", None)
        if original is not None:  # the fp32-output wrapper the Accelerator put on the instance
            model.forward = original
    if keep_torch_compile and compiled is not None:
        compiled._orig_mod = model
        return compiled
    return model


def get_module_children_bottom_up(model: nn.Module, return_fqns: bool = False) -> list[Any]:
    """Every submodule of ``model``, children before parents (``model`` itself last)."""
    out: list[Any] = []

    def visit(module: nn.Module, name: str) -> None:
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name)
        out.append((name, module) if return_fqns else module)

    visit(model, "")
    return out


def model_has_dtensor(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a ``DTensor`` (sharded by FSDP2 or tensor parallelism)."""
    if "torch.distributed.tensor" not in sys.modules:  # no DTensor exists before that import (seconds)
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def get_model_tp_size(model: nn.Module) -> int:
    """The tensor-parallel degree of ``model``: the size of a ``"tp"`` mesh dimension of its DTensors, else 1."""
    if "torch.distributed.tensor" not in sys.modules:  # no DTensor exists before that import (seconds)
        return 1
    from torch.distributed.tensor import DTensor

    for parameter in model.parameters():
        if isinstance(parameter, DTensor):
            names = parameter.device_mesh.mesh_dim_names or ()
            if "tp" in names:
                return parameter.device_mesh.size(names.index("tp"))
    return 1


def is_repeated_blocks(module: nn.Module) -> bool:
    """Whether ``module`` is an ``nn.ModuleList`` whose children all share the first child's class.

    Example:
        >>> is_repeated_blocks(nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]))
        True
    """
    return isinstance(module, nn.ModuleList) and len(module) > 0 and all(
        isinstance(m, module[0].__class__) for m in module)


def has_repeated_blocks(module: nn.Module) -> bool:
    """Whether ``module`` holds repeated blocks (:func:`is_repeated_blocks`) at any depth."""
    return bool(module._modules) and any(is_repeated_blocks(m) for m in module.modules())


def get_module_class_from_name(module: nn.Module, name: str) -> type | None:
    """The class named ``name`` among ``module`` and its descendants (depth first), else None.

    Example:
        >>> get_module_class_from_name(nn.Sequential(nn.ReLU()), "ReLU")
        <class 'torch.nn.modules.activation.ReLU'>
    """
    if module.__class__.__name__ == name:
        return module.__class__
    for child in module.children():
        found = get_module_class_from_name(child, name)
        if found is not None:
            return found
    return None


def _repeated_blocks(module: nn.Module) -> Iterator[nn.ModuleList]:
    # regional compilation compiles each block of a list of two or more: one block gains nothing
    for child in module.modules():
        if is_repeated_blocks(child) and len(child) > 1:  # type: ignore[arg-type]
            yield child  # type: ignore[misc]


def compile_regions(module: nn.Module, **compile_kwargs: Any) -> nn.Module:
    """Regional compilation: compile each block of a repeated stack (``ModuleList`` of one class) once per
    block, hitting the compiler's cache after the first; a model without one is compiled whole.

    The given module is left unchanged: the result is a shallow copy whose repeated blocks are compiled.
    """
    if not any(True for _ in _repeated_blocks(module)):
        return torch.compile(module, **compile_kwargs)  # type: ignore[return-value]

    def copy_with_compiled_blocks(current: nn.Module) -> nn.Module:
        new = current.__class__.__new__(current.__class__)
        new.__dict__.update(current.__dict__)
        new._modules = {}
        repeated = isinstance(current, nn.ModuleList) and len(current) > 1 and len({type(m) for m in current}) == 1
        for name, child in current._modules.items():
            if child is None:
                new._modules[name] = None
            elif repeated:
                # torch.compile returns an OptimizedModule (a Module) for a Module; its stub says "a callable"
                new._modules[name] = cast(nn.Module, torch.compile(child, **compile_kwargs))
            else:
                new._modules[name] = copy_with_compiled_blocks(child)
        return new

    compiled = copy_with_compiled_blocks(module)
    compiled.__dict__["_orig_mod"] = module
    return compiled


def compile_regions_deepspeed(module: nn.Module, **compile_kwargs: Any) -> None:
    """Regional compilation in place (``block.compile()``), as DeepSpeed's engine requires."""
    for blocks in _repeated_blocks(module):
        for block in blocks:
            block.compile(**compile_kwargs)


def compile_regions_fsdp2(module: nn.Module, **compile_kwargs: Any) -> None:
    """Regional compilation in place for an FSDP2-sharded model (each repeated block is its own unit)."""
    compile_regions_deepspeed(module, **compile_kwargs)


def has_compiled_regions(module: nn.Module) -> bool:
    """Whether ``module`` has regionally compiled blocks (from :func:`compile_regions`)."""
    if "_orig_mod" in module.__dict__ and not is_compiled_module(module):
        return True
    return any(is_compiled_module(m) for m in module.modules() if m is not module)


def _has_layer(model: nn.Module, package: str, class_names: tuple[str, ...]) -> bool:
    return any(type(m).__module__.startswith(package) and type(m).__name__ in class_names for m in model.modules())


def has_4bit_bnb_layers(model: nn.Module) -> bool:
    """Whether ``model`` has bitsandbytes 4-bit linear layers."""
    return _has_layer(model, "bitsandbytes", ("Linear4bit",))


def has_ao_layers(model: nn.Module) -> bool:
    """Whether ``model`` has torchao float8 linear layers."""
    return _has_layer(model, "torchao", ("Float8Linear",))


def has_transformer_engine_layers(model: nn.Module) -> bool:
    """Whether ``model`` has Transformer Engine layers."""
    return _has_layer(model, "transformer_engine", ("LayerNorm", "Linear", "TransformerLayer", "LayerNormLinear"))


def check_tied_parameters_in_config(model: nn.Module) -> bool:
    """Whether a 🤗 Transformers model's config asks for tied weights (word embeddings, encoder-decoder, ...)."""
    config = getattr(model, "config", None)
    if config is None:
        return False
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    tied_embeddings = bool(getattr(config, "tie_word_embeddings", False)) and \
        callable(get_output_embeddings) and get_output_embeddings() is not None
    tied_encoder_decoder = bool(getattr(config, "is_encoder_decoder", False)) and \
        bool(getattr(config, "tie_encoder_decoder", False))
    tied_modules = any(hasattr(m, "_tie_weights") for m in model.modules())
    return tied_embeddings or tied_encoder_decoder or tied_modules


def torchao_required(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: raise a ``MissingDependencyError`` unless torchao is installed."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not is_torchao_available():
            raise MissingDependencyError("torchao", f"`{func.__name__}`")
        return func(*args, **kwargs)

    return wrapper


def get_grad_scaler(distributed_type: Any = None, **kwargs: Any) -> torch.amp.GradScaler:
    """A ``torch.amp.GradScaler`` for this process's device (fp16 mixed precision)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.amp.GradScaler(device, **kwargs)


def get_fsdp2_grad_scaler(**kwargs: Any) -> torch.amp.GradScaler:
    """The grad scaler for FSDP2 (torch's ``GradScaler`` handles DTensor gradients)."""
    return get_grad_scaler(None, **kwargs)


# Names Accelerate shows at this module path but hasten defines elsewhere (hasten/_accelerate_paths.py).
__getattr__ = accelerate_path_getattr(__name__, globals())
