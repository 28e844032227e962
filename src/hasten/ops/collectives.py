"""Collectives over nested tensor structures, on torch.distributed.

Every function is the identity (or a copy) when no process group is running, so the same code works
with one process. All processes must call them; in debug mode a mismatch raises instead of hanging.

``gather``, ``reduce`` and ``broadcast`` never hand back data built from inputs whose shapes or dtypes
differ across ranks (the engines copy raw bytes and would return garbage): before the data moves, the
ranks all-gather one 64-bit fingerprint of the operation and of their inputs' layout; a difference
raises :class:`DistributedOperationError` on every rank, naming each rank's shapes and dtypes.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from hasten.exceptions import DistributedOperationError
from hasten.ops.tree import is_torch_tensor, recursively_apply
from hasten.runtime.debug_checks import (
    debug_checks_enabled,
    describe,
    format_description,
    verify_operation,
)
from hasten.runtime.watchdog import tracked


def is_distributed() -> bool:
    """True when a process group with more than one process is running."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _check_tensors(data: Any, op: str) -> None:
    """Raise a TypeError naming the first leaf that is not a tensor."""
    if isinstance(data, (list, tuple)):
        for item in data:
            _check_tensors(item, op)
    elif isinstance(data, Mapping):
        for item in data.values():
            _check_tensors(item, op)
    elif not is_torch_tensor(data):
        raise TypeError(
            f"`{op}` got a {type(data).__name__} ({data!r:.60}); it supports tensors in nested lists, tuples "
            "and dicts. HINT: use `gather_object` / `broadcast_object_list` for other Python objects.")


def _first_tensor(data: Any) -> torch.Tensor | None:
    if isinstance(data, torch.Tensor):
        return data
    items = data.values() if isinstance(data, Mapping) else data if isinstance(data, (list, tuple)) else ()
    for item in items:
        found = _first_tensor(item)
        if found is not None:
            return found
    return None


def _fingerprint_device(data: Any) -> torch.device:
    first = _first_tensor(data)
    if first is not None:
        return first.device
    if "gloo" not in str(dist.get_backend()) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_same_layout(op: str, data: Any, hint: str = "", desc: Any = None) -> None:
    """Raise on every rank unless all ranks call ``op`` with the same structure, shapes and dtypes.

    Costs one all-gather of one int64 per rank (the fingerprint of ``describe(data)`` and ``op``); the
    descriptions themselves travel only when the fingerprints differ. Debug mode compares the same
    things before every collective, so the check is skipped there. ``desc`` replaces ``describe(data)``
    where only the kind of call must agree (:func:`gather_object`).

    Raises:
        DistributedOperationError: the ranks' inputs differ (every rank raises, with each rank's view).
    """
    if debug_checks_enabled():
        return
    desc = describe(data) if desc is None else desc
    digest = hashlib.blake2b(repr((op, desc)).encode(), digest_size=8).digest()
    mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64,
                        device=_fingerprint_device(data))
    prints = [torch.empty_like(mine) for _ in range(_world())]
    dist.all_gather(prints, mine)
    if len({int(p.item()) for p in prints}) == 1:
        return
    views: list[Any] = [None] * _world()
    dist.all_gather_object(views, (op, desc))
    lines = "\n".join(f"  rank {r}: `{v[0]}` with {format_description(v[1])}" for r, v in enumerate(views))
    raise DistributedOperationError(
        f"`{op}` needs the same structure, shapes and dtypes on every process, but they differ (seen from rank "
        f"{dist.get_rank()}):\n{lines}\nNo data was exchanged." + (f" HINT: {hint}" if hint else ""))


_GATHER_HINT = ("use `accelerator.pad_across_processes` before `gather` for tensors whose length differs, "
                "or `gather_object` for Python objects.")


_OBJECT_HINT = ("pass the same kind of data on every process: tensors everywhere (gather), or Python objects "
                "everywhere (gather_object, or gather_for_metrics(..., use_gather_object=True)).")


def gather(tensor: Any) -> Any:
    """All-gather tensors from every process and concatenate them on the first dimension.

    Nested lists, tuples and dicts are gathered leaf by leaf; 0-d tensors become 1-d. Shapes must be
    equal on all ranks (use :func:`pad_across_processes` first otherwise).

    Example:
        >>> gather(torch.tensor([rank]))  # on 2 processes -> tensor([0, 1])

    Raises:
        TypeError: a leaf is not a tensor.
        DistributedOperationError: shapes or dtypes differ across ranks (raised on every rank).
    """
    _check_tensors(tensor, "gather")
    if not is_distributed():
        return tensor
    with tracked("gather", tensor):
        if debug_checks_enabled():
            verify_operation("gather", tensor)
        check_same_layout("gather", tensor, _GATHER_HINT)
        return recursively_apply(_gather_one, tensor)


def _gather_one(t: torch.Tensor) -> torch.Tensor:
    world = _world()
    if t.ndim == 0:
        t = t.clone()[None]
    t = t.contiguous()
    if dist.get_backend() == "nccl":
        out = torch.empty((world * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        dist.all_gather_into_tensor(out, t)
        return out
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t)
    return torch.cat(parts, dim=0)


def gather_object(object: Any) -> Any:  # noqa: A002 - Accelerate's parameter name
    """Gather picklable objects from every process.

    Each process usually passes a list; the lists are joined in rank order (one level flattened, as in
    Accelerate). A non-list object counts as one item. With one process the input is returned unchanged.

    Example:
        >>> gather_object([f"rank {rank}"])  # on 2 processes -> ['rank 0', 'rank 1']
    """
    if not is_distributed():
        return object
    parts: list[Any] = [None] * _world()
    with tracked("gather_object"):
        if debug_checks_enabled():
            verify_operation("gather_object", None, same_shapes=False)
        # A process calling `gather` (tensors) while another gathers objects would otherwise exchange a
        # fingerprint for an object size and try to allocate exabytes: both raise, naming both calls.
        check_same_layout("gather_object", None, _OBJECT_HINT, desc="Python objects")
        dist.all_gather_object(parts, object)
    out: list[Any] = []
    for part in parts:
        if isinstance(part, (list, tuple)):
            out.extend(part)
        else:
            out.append(part)
    return out


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Copy tensors from ``from_process`` to every process, in place; returns the data.

    Every process passes tensors of the source's shapes and dtypes (the receivers' are overwritten).

    Example:
        >>> broadcast(torch.tensor([rank]))  # -> tensor([0]) everywhere

    Raises:
        DistributedOperationError: shapes or dtypes differ across ranks (raised on every rank).
    """
    _check_tensors(tensor, "broadcast")
    if not is_distributed():
        return tensor
    _check_rank(from_process, "broadcast")
    def _bcast(t: torch.Tensor) -> torch.Tensor:
        dist.broadcast(t, src=from_process)
        return t

    with tracked("broadcast", tensor):
        if debug_checks_enabled():
            verify_operation("broadcast", tensor)
        check_same_layout(f"broadcast(from_process={from_process})", tensor,
                          "allocate the receiving tensors with the source's shape and dtype, or use "
                          "`broadcast_object_list` for data whose shape only the source knows.")
        return recursively_apply(_bcast, tensor)


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """Copy the picklable items of ``object_list`` from ``from_process`` into every process's list, in place."""
    if not isinstance(object_list, list):
        raise TypeError(f"broadcast_object_list expects a list, got {type(object_list).__name__}")
    if not is_distributed():
        return object_list
    _check_rank(from_process, "broadcast_object_list")
    with tracked("broadcast_object_list"):
        if debug_checks_enabled():
            verify_operation("broadcast_object_list", [len(object_list)], same_shapes=False)
        dist.broadcast_object_list(object_list, src=from_process)
    return object_list


_REDUCE_OPS = ("sum", "mean", "max", "min", "none")


def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """Reduce tensors across processes; returns new tensors (inputs are not modified).

    Args:
        tensor: a tensor or nested structure of tensors.
        reduction: ``"mean"`` (default here, as in ``accelerate.utils.reduce``), ``"sum"``, ``"max"``,
            ``"min"``, or ``"none"`` (a copy, no communication: what Accelerate documents but does not do).
        scale: multiply the result by this factor.

    Raises:
        ValueError: an unknown ``reduction``.
        DistributedOperationError: shapes or dtypes differ across ranks (raised on every rank).
    """
    if reduction not in _REDUCE_OPS:
        raise ValueError(f"reduce(reduction={reduction!r}) is not supported: use one of {_REDUCE_OPS}")
    _check_tensors(tensor, "reduce")
    distributed = is_distributed() and reduction != "none"
    world = _world()

    def _reduce_one(t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        if distributed:
            op = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}.get(reduction, dist.ReduceOp.SUM)
            dist.all_reduce(out, op=op)
            if reduction == "mean":
                out = out / world if not out.is_floating_point() else out.div_(world)
        if scale != 1.0:
            out = out * scale
        return out

    if not distributed:
        return recursively_apply(_reduce_one, tensor)
    with tracked(f"reduce({reduction})", tensor):
        if debug_checks_enabled():
            verify_operation(f"reduce({reduction})", tensor)
        check_same_layout(f"reduce({reduction})", tensor, "reduce tensors of one shape and dtype on every process.")
        return recursively_apply(_reduce_one, tensor)


def pad_across_processes(tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
    """Pad tensors along ``dim`` to the largest size found on any process, so they can be gathered.

    Args:
        tensor: a tensor or nested structure of tensors (same number of dimensions on every rank).
        dim: the dimension to pad (negative values count from the end).
        pad_index: the fill value.
        pad_first: pad at the start instead of the end.

    A tensor whose ``dim`` is out of range (a 1-d label tensor asked to pad ``dim=1``, as Transformers'
    ``Trainer.evaluate`` does) is returned unchanged, as Accelerate does.
    """
    _check_tensors(tensor, "pad_across_processes")
    recursively_apply(_warn_nested, tensor)
    if not is_distributed():
        return tensor
    with tracked("pad_across_processes", tensor):
        if debug_checks_enabled():
            verify_operation("pad_across_processes", tensor, same_ndim_only=True)
        return recursively_apply(_pad_one, tensor, dim, pad_index, pad_first)


class CannotPadNestedTensorWarning(UserWarning):
    """``pad_across_processes`` met a nested tensor, which it cannot pad (it is returned unchanged)."""


def _warn_nested(t: torch.Tensor) -> torch.Tensor:
    if t.is_nested:
        warnings.warn("Cannot pad nested tensors without more information. Leaving unprocessed.",
                      CannotPadNestedTensorWarning, stacklevel=4)
    return t


def _pad_one(t: torch.Tensor, dim: int, pad_index: int, pad_first: bool) -> torch.Tensor:
    """Pad one tensor along ``dim`` to the largest size of any rank (one all-gather of the size). A nested
    tensor, or one without dimension ``dim``, is returned as it is (Accelerate's rules)."""
    if t.is_nested or not -t.ndim <= dim < t.ndim:
        return t
    d = dim % t.ndim
    size = torch.tensor([t.shape[d]], device=t.device, dtype=torch.int64)
    sizes = [torch.empty_like(size) for _ in range(_world())]
    dist.all_gather(sizes, size)
    max_size = int(max(s.item() for s in sizes))
    if max_size == t.shape[d]:
        return t
    new_shape = list(t.shape)
    new_shape[d] = max_size
    out = t.new_full(new_shape, pad_index)
    index = [slice(None)] * t.ndim
    index[d] = slice(max_size - t.shape[d], max_size) if pad_first else slice(0, t.shape[d])
    out[tuple(index)] = t
    return out


def pad_input_tensors(tensor: Any, batch_size: int, num_processes: int, dim: int = 0) -> Any:
    """Pad a batch (by repeating zeros) so that it splits evenly across ``num_processes``."""
    def _pad(t: torch.Tensor) -> torch.Tensor:
        remainder = batch_size % num_processes
        if remainder == 0:
            return t
        extra = num_processes - remainder
        shape = list(t.shape)
        shape[dim] = extra
        return torch.cat([t, t.new_zeros(shape)], dim=dim)

    return recursively_apply(_pad, tensor)


def barrier() -> None:
    """Wait until every process reaches this point (no-op with one process)."""
    if not is_distributed():
        return
    with tracked("wait_for_everyone"):
        if debug_checks_enabled():
            verify_operation("wait_for_everyone", None, same_shapes=False)
        dist.barrier()


def _check_rank(rank: int, op: str) -> None:
    world = _world()
    if not 0 <= rank < world:
        raise ValueError(f"{op}(from_process={rank}) is not a rank of this run: use 0..{world - 1}")
