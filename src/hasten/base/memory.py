"""Memory helpers: ``find_executable_batch_size`` (retry with a smaller batch on out-of-memory),
``release_memory`` and ``clear_device_cache``."""

from __future__ import annotations

import functools
import gc
import inspect
from collections.abc import Callable
from typing import Any

import torch

from hasten._lazy import accelerate_path_getattr

# Messages of the RuntimeErrors that mean "this batch does not fit" (as recognised by Accelerate).
_OOM_MESSAGES = (
    " out of memory.",  # CUDA, ROCm/HIP, XPU
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",  # cuDNN's way of failing on too-large inputs
    "DefaultCPUAllocator: can't allocate memory",  # CPU
    "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed",  # Gaudi (HPU)
)


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Return cached, unused accelerator memory to the driver (and run the garbage collector if asked).

    Only backends already in use are touched: on a machine with a GPU that this process never used,
    no CUDA context is created.

    Example:
        >>> del activations
        >>> clear_device_cache(garbage_collection=True)
    """
    if garbage_collection:
        gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        xpu.empty_cache()
    mps_backend = getattr(torch.backends, "mps", None)
    if mps_backend is not None and mps_backend.is_available():
        torch.mps.empty_cache()


def release_memory(*objects: Any) -> list[None]:
    """Drop references to ``objects``, collect garbage and empty the device cache; returns ``[None, ...]``.

    Rebind your names to the result, otherwise they keep the objects alive.

    Example:
        >>> model, optimizer = release_memory(model, optimizer)
    """
    released: list[None] = [None for _ in objects]
    del objects
    clear_device_cache(garbage_collection=True)
    return released


def should_reduce_batch_size(exception: BaseException) -> bool:
    """True when ``exception`` means the batch did not fit in memory (CUDA/XPU/HPU OOM, CPU allocation
    failure, ``torch.OutOfMemoryError`` or Python's ``MemoryError``).

    Example:
        >>> should_reduce_batch_size(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
        True
    """
    if isinstance(exception, (torch.OutOfMemoryError, MemoryError)):
        return True
    if isinstance(exception, RuntimeError) and len(exception.args) == 1 and isinstance(exception.args[0], str):
        return any(message in exception.args[0] for message in _OOM_MESSAGES)
    return False


def _accepts_an_argument(function: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # some builtins have no signature: call them the Accelerate way
        return False
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in parameters)


def _make_reducer(reduce_batch_size_fn: Callable[..., int] | None) -> Callable[[int], int]:
    if reduce_batch_size_fn is None:
        return lambda batch_size: int(batch_size * 0.9)
    # Accelerate calls the function without arguments; a function that takes one gets the failed size.
    takes_size = _accepts_an_argument(reduce_batch_size_fn)

    def reduce(batch_size: int) -> int:
        new_size = reduce_batch_size_fn(batch_size) if takes_size else reduce_batch_size_fn()
        if isinstance(new_size, bool) or not isinstance(new_size, int):
            raise TypeError(f"reduce_batch_size_fn returned {new_size!r}; it must return the next batch size "
                            "to try, as an int.")
        if new_size >= batch_size:
            raise ValueError(f"reduce_batch_size_fn returned {new_size} after batch size {batch_size} ran out of "
                             "memory; it must return a smaller size, or the search would never end.")
        return new_size

    return reduce


def _check_batch_size_not_passed(function: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return
    if any(p.kind is p.VAR_POSITIONAL for p in parameters):
        return  # *args: cannot tell
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(args) + 1 > len(positional):
        shown = ", ".join(f"{p.name}={value!r}" for p, value in zip(positional[1:], args[1:]))
        raise TypeError(f"The batch size was passed to `{function.__name__}` as its first argument; the decorator "
                        f"supplies it. Call it without: `{function.__name__}({shown})`.")


def find_executable_batch_size(function: Callable[..., Any] | None = None, starting_batch_size: int = 128,
                               reduce_batch_size_fn: Callable[..., int] | None = None, *,
                               plan: Callable[[int], int] | None = None) -> Any:
    """Decorator: call ``function(batch_size, *args, **kwargs)``, retrying with a smaller batch on OOM.

    Tries ``starting_batch_size`` first; when the call fails with an out-of-memory error (see
    :func:`should_reduce_batch_size`) it frees memory (garbage collection + device cache) and tries
    again with ``int(batch_size * 0.9)``, or with what ``reduce_batch_size_fn`` returns (called with
    no argument, as in Accelerate, or with the failed size if it takes one). The last size that worked
    is remembered for later calls. Other errors propagate unchanged.

    ``plan`` (hasten's addition, keyword only): start from a memory plan instead of a guess, a
    :class:`hasten.memory_plan.BatchSizePlan` (model, budget per process and ``plan_memory``'s keywords).
    It is called once, on the first call, with ``starting_batch_size``, and the first size tried is what it
    returns: the largest whose planned step fits the budget, at most ``starting_batch_size``. A real
    out-of-memory error still reduces it as above (the plan leaves out the allocator's overheads).

    Differences from Accelerate (kept signature): ``@find_executable_batch_size(starting_batch_size=...,
    reduce_batch_size_fn=...)`` keeps ``reduce_batch_size_fn`` (Accelerate drops it in that form), and
    memory is freed after the failed call's exception and traceback (which hold its tensors) are gone,
    so the retry really gets that memory back.

    Raises:
        RuntimeError: the batch size reached zero without a call succeeding, or the plan says not even a batch
            of one fits the budget.
        TypeError: the caller passed the batch size itself.
        PlanError: the plan cannot be made (one line naming the bad value).

    Example:
        >>> @find_executable_batch_size(starting_batch_size=256)
        ... def train(batch_size, model, optimizer):
        ...     loader = DataLoader(dataset, batch_size=batch_size)
        ...     ...
        >>> train(model, optimizer)
    """
    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn, plan=plan)
    if isinstance(starting_batch_size, bool) or not isinstance(starting_batch_size, int):
        raise TypeError(f"starting_batch_size must be an int, got {starting_batch_size!r}")
    reduce = _make_reducer(reduce_batch_size_fn)
    batch_size = starting_batch_size
    pending_plan = plan

    @functools.wraps(function)
    def decorator(*args: Any, **kwargs: Any) -> Any:
        nonlocal batch_size, pending_plan
        _check_batch_size_not_passed(function, args)
        if pending_plan is not None:
            batch_size = min(batch_size, int(pending_plan(batch_size)))
            pending_plan = None
            if batch_size <= 0:
                raise RuntimeError("No executable batch size found: the memory plan says not even a batch of one "
                                   "fits the budget (see `hasten estimate-memory --train --budget` for layouts).")
        clear_device_cache(garbage_collection=True)
        while True:
            if batch_size <= 0:
                raise RuntimeError("No executable batch size found, reached zero.")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as exc:
                if not should_reduce_batch_size(exc):
                    raise
            # Outside the except block the exception and its traceback (holding the failed call's frames
            # and tensors) are released, so collecting now actually frees that memory.
            clear_device_cache(garbage_collection=True)
            batch_size = reduce(batch_size)

    return decorator

# Names Accelerate's module at this path shows but defines elsewhere (hasten/_accelerate_shown.py).
__getattr__ = accelerate_path_getattr(__name__, globals())
