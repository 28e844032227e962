"""The rest of ``accelerate.utils.operations``: tensor descriptions, fp32 output wrappers, decorators.

``hasten.utils.operations`` re-exports these next to the collectives and tree helpers of
:mod:`hasten.ops`, so code importing from Accelerate's internal module path keeps working.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hasten.exceptions import DistributedOperationError
from hasten.ops.collectives import is_distributed
from hasten.ops.tree import convert_to_fp32, recursively_apply
from hasten.runtime.debug_checks import debug_checks_enabled, verify_operation as _verify

#: Accelerate's integer codes of tensor dtypes (its ``gather_tensor_shape`` metadata) and their inverse.
TENSOR_TYPE_TO_INT: dict[torch.dtype, int] = {
    torch.float32: 1, torch.float64: 2, torch.float16: 3, torch.bfloat16: 4, torch.uint8: 5, torch.int8: 6,
    torch.int16: 7, torch.int32: 8, torch.int64: 9, torch.bool: 10}
TENSOR_INT_TO_DTYPE: dict[int, torch.dtype] = {code: dtype for dtype, code in TENSOR_TYPE_TO_INT.items()}


@dataclass
class TensorInformation:
    """The shape and dtype of a tensor, to build an empty one of the same kind on another rank."""

    shape: torch.Size
    dtype: torch.dtype


def is_tensor_information(tensor_info: Any) -> bool:
    """True for a :class:`TensorInformation`."""
    return isinstance(tensor_info, TensorInformation)


def is_torch_xpu_tensor(tensor: Any) -> bool:
    """True for a tensor on an Intel XPU."""
    return isinstance(tensor, torch.Tensor) and tensor.device.type == "xpu"


def initialize_tensors(data_structure: Any) -> Any:
    """Replace every :class:`TensorInformation` of a nested structure by an empty tensor of that kind."""
    return recursively_apply(lambda info: torch.empty(info.shape, dtype=info.dtype), data_structure,
                             test_type=is_tensor_information)


def get_shape(data: Any) -> Any:
    """The shapes (as lists) of every tensor of a nested structure."""
    return recursively_apply(lambda t: list(t.shape), data)


def gather_tensor_shape(tensor: torch.Tensor) -> list[int]:
    """The shape of the tensor held by the one rank that has it (the others pass ``None``); every rank gets it."""
    if not is_distributed():
        return list(tensor.shape)
    shapes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(shapes, None if tensor is None else list(tensor.shape))
    return next(shape for shape in shapes if shape is not None)


def copy_tensor_to_devices(tensor: torch.Tensor | None = None) -> torch.Tensor:
    """Copy the tensor that one process holds to every process (the others pass ``None``; they need not
    know its shape). Any one process may hold it: the pipeline's last stage, for example."""
    if not is_distributed():
        assert tensor is not None, "copy_tensor_to_devices needs the tensor on the process that holds it"
        return tensor
    metas: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(metas, None if tensor is None else (tuple(tensor.shape), tensor.dtype))
    holders = [rank for rank, meta in enumerate(metas) if meta is not None]
    if not holders:
        raise ValueError("copy_tensor_to_devices: no process passed a tensor.")
    source = holders[0]
    shape, dtype = metas[source]
    if tensor is None:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        tensor = torch.zeros(shape, dtype=dtype, device=device)
    dist.broadcast(tensor, src=source)
    return tensor


def verify_operation(function: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: in debug mode, check that all ranks call ``function`` with tensors of the same shapes."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if debug_checks_enabled():
            data = kwargs["tensor"] if "tensor" in kwargs else (args[0] if args else None)
            _verify(function.__name__, data)
        return function(*args, **kwargs)

    return wrapper


def chained_operation(function: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: a ``DistributedOperationException`` raised inside names the outer operation too."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except DistributedOperationError as error:
            raise DistributedOperationError(f"Error found while calling `{function.__name__}`: {error}") from error

    return wrapper


class ConvertOutputsToFp32:
    """Wrap a forward function so that its fp16/bf16 outputs come back as fp32 (picklable, unlike a closure)."""

    def __init__(self, model_forward: Callable[..., Any]) -> None:
        self.model_forward = model_forward
        functools.update_wrapper(self, model_forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return convert_to_fp32(self.model_forward(*args, **kwargs))

    def __getstate__(self) -> Any:
        raise TypeError("Cannot pickle a prepared model with automatic mixed precision; unwrap it first "
                        "with `accelerator.unwrap_model(model)`.")


def convert_outputs_to_fp32(model_forward: Callable[..., Any]) -> Callable[..., Any]:
    """``model_forward`` with fp32 outputs (see :class:`ConvertOutputsToFp32`)."""
    wrapped = ConvertOutputsToFp32(model_forward)

    @functools.wraps(model_forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return wrapped(*args, **kwargs)

    forward.__wrapped__ = model_forward  # type: ignore[attr-defined]
    return forward


def GatheredParameters(params: Any, modifier_rank: int | None = None, fwd_module: Any = None,  # noqa: N802
                       enabled: bool = True) -> contextlib.AbstractContextManager[Any]:
    """DeepSpeed ZeRO-3's ``GatheredParameters`` when DeepSpeed is installed, else a do-nothing context."""
    try:
        import deepspeed
    except ImportError:
        return contextlib.nullcontext()
    return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank, fwd_module=fwd_module,
                                             enabled=enabled)
