"""Host buffers for asynchronous saves: the snapshot is tensor copies into memory reused between saves.

An asynchronous save must copy the state before training goes on (the optimizer changes the
parameters and its moments in place, on the CPU as well), but it should copy *only*: serialising
(safetensors, ``torch.save``) is left to the background thread, which serialises the copies.
:meth:`HostBuffers.stage` returns a copy of a state (a state dict, an optimizer's state dict, any
nested dicts/lists/tuples) in which every plain tensor is replaced by a tensor of the same dtype,
offset, shape and strides over a **host buffer**: a host storage the size of the source's storage.
Tensors that share a storage share a buffer, so ``torch.save`` of the copy writes the same storages,
in the same order, as ``torch.save`` of the original: the files are byte for byte those of a
synchronous save. A DTensor of a sharded state dict is staged as a DTensor of the same spec over a
copy of this process's local shard only (what ``torch.distributed.checkpoint`` writes). The rest of
the state (numbers, strings, NumPy arrays, anything else) is deep-copied, which is cheap for what a
checkpoint holds besides tensors.

Memory: the buffers are allocated by the first asynchronous save and reused by the next ones (a
buffer is reused when a storage of the same size and kind needs one: the same parameters and
optimizer moments, save after save). Allocating fresh host memory costs more than the copy itself
(first-touch page faults, several times a ``memcpy``), which is why the buffers are kept. A save frees
the buffers it did not reuse, so the set is bounded by one snapshot: the bytes of the storages this
process writes (model weights, optimizer state, accumulated gradients; the small states besides).
:meth:`HostBuffers.release` frees them (``end_training``). When the source is on a CUDA device the
buffer is pinned host memory and the copies are asynchronous, waited for once before the save returns.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

# The location tags torch.save consults, set only on the thread that writes a snapshot's files and only
# while it does (HostBuffers.tagging): a save on any other thread, or any later one, never sees them.
_WRITING = threading.local()
_TAGGER_REGISTERED = False


def _location_of_staged(storage: Any) -> str | None:
    locations: dict[int, str] | None = getattr(_WRITING, "locations", None)
    if not locations:
        return None
    storage = getattr(storage, "_untyped_storage", storage)
    if storage.device.type != "cpu":
        return None
    return locations.get(storage.data_ptr())


def _never_loads(storage: Any, location: str) -> None:
    return None  # tagging only: loading goes through torch's own deserialisers


def _register_tagger() -> None:
    global _TAGGER_REGISTERED
    if not _TAGGER_REGISTERED:
        # torch has one process-wide list of taggers; this one answers only inside HostBuffers.tagging().
        # priority 1: before torch's CPU tagger (10), which would call the pinned copy "cpu"
        torch.serialization.register_package(1, _location_of_staged, _never_loads)
        _TAGGER_REGISTERED = True


def _stageable(tensor: torch.Tensor) -> bool:
    """A plain dense tensor whose copy pickles exactly like it (subclasses, Parameters, tensors with
    attributes or autograd state are deep-copied instead)."""
    return (type(tensor) is torch.Tensor and not tensor.requires_grad and tensor.layout == torch.strided
            and not tensor.is_quantized and tensor.device.type != "meta" and not tensor.is_conj()
            and not tensor.is_neg() and not tensor.__dict__)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    if type(tensor).__name__ != "DTensor":  # no import of torch.distributed for plain states
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors in nested dicts, lists and tuples (elsewhere deep-copying finds them)."""
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


_Key = tuple[int, bool]  # (bytes, pinned)


class HostBuffers:
    """One process's host buffers for asynchronous saves, reused from one save to the next.

    Use: :meth:`begin` when a save starts its snapshot (the previous save is finished), :meth:`stage`
    for each state, :meth:`end` before the save returns (waits for device copies, frees the buffers this
    save did not reuse), :meth:`release` at the end of training.
    """

    def __init__(self) -> None:
        self._free: dict[_Key, list[torch.UntypedStorage]] = {}
        self._used: list[tuple[_Key, torch.UntypedStorage]] = []
        # This save: source storage -> (the source itself, its buffer). Sharing is recognised by address, so
        # the source is kept alive until end(): a temporary state freed mid-snapshot (a generator's state)
        # could otherwise hand its address to the next one, which would then get the first one's bytes.
        self._staged: dict[tuple[str, int, int], tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}
        self._devices: set[torch.device] = set()
        # data_ptr of a pinned buffer holding a CUDA storage's copy -> that storage's location tag ("cuda:0"),
        # so that torch.save of the copy writes the location a synchronous save of the CUDA tensors writes.
        self._locations: dict[int, str] = {}

    @contextmanager
    def tagging(self) -> Iterator[None]:
        """While the block runs, ``torch.save`` on this thread names each CUDA source's device for its staged
        copy (the background thread, writing the snapshot's files); nowhere else."""
        previous = getattr(_WRITING, "locations", None)
        _WRITING.locations = self._locations
        try:
            yield
        finally:
            _WRITING.locations = previous

    @property
    def nbytes(self) -> int:
        """Host memory held by the buffers (in use and free)."""
        return sum(k[0] for k, _ in self._used) + sum(k[0] * len(v) for k, v in self._free.items())

    def begin(self) -> None:
        """Start a snapshot: every buffer of the previous save (written by now) can be reused."""
        for key, buffer in self._used:
            self._free.setdefault(key, []).append(buffer)
        self._used, self._staged = [], {}

    def stage(self, state: Any) -> Any:
        """A copy of ``state`` whose tensors live in host buffers (copied now); the rest deep-copied.

        A DTensor (a sharded state dict's entry) becomes a DTensor of the same spec (mesh, placements,
        global shape) over a host copy of this process's local shard: what
        ``torch.distributed.checkpoint`` plans and writes from, as it does for its own CPU staging.
        """
        memo: dict[int, Any] = {}
        for tensor in _tensors(state):
            if id(tensor) in memo:
                continue
            if _stageable(tensor):
                memo[id(tensor)] = self._staged_view(tensor, tag=True)
            elif _is_dtensor(tensor):
                staged = self._staged_dtensor(tensor)
                if staged is not None:
                    memo[id(tensor)] = staged
        return copy.deepcopy(state, memo)

    def _staged_dtensor(self, tensor: Any) -> Any:
        """A DTensor of ``tensor``'s spec over a staged copy of its local shard (None: deep-copy it instead)."""
        from torch.distributed.tensor import DTensor

        local = tensor._local_tensor
        if tensor.requires_grad or not _stageable(local):
            return None
        # No location tag: DCP writes every shard from a CPU tensor, whatever the device of the source.
        return DTensor(self._staged_view(local, tag=False), tensor._spec, requires_grad=False)

    def _staged_view(self, tensor: torch.Tensor, *, tag: bool) -> torch.Tensor:
        buffer = self._copy_of(tensor.untyped_storage(), tag=tag)
        staged = torch.empty(0, dtype=tensor.dtype)
        staged.set_(buffer, tensor.storage_offset(), tensor.size(), tensor.stride())
        return staged

    def end(self) -> None:
        """Wait for the copies from devices; free the buffers this snapshot did not reuse."""
        for device in self._devices:
            torch.cuda.current_stream(device).synchronize()
        self._devices.clear()
        self._staged = {}
        self._drop(self._free_pairs())
        self._free = {}

    def release(self) -> None:
        """Free every buffer (call it when no save is in flight)."""
        self._drop(self._free_pairs())
        # a list, not a dict by key: several buffers in use share a size, and each one's location tag must go
        # (a stale tag would label an unrelated pinned tensor at a reused address "cuda:N" in torch.save)
        self._drop(self._used)
        self._free, self._used, self._staged = {}, [], {}

    def _copy_of(self, source: torch.UntypedStorage, *, tag: bool = True) -> torch.UntypedStorage:
        ident = (str(source.device), source.data_ptr(), source.nbytes())
        if ident in self._staged and source.nbytes():  # tensors sharing a storage share its copy
            return self._staged[ident][1]
        pinned = source.device.type == "cuda"
        key = (source.nbytes(), pinned)
        free = self._free.get(key)
        if free:
            buffer = free.pop()
        else:
            buffer = torch.empty(key[0], dtype=torch.uint8, pin_memory=pinned).untyped_storage()
        if pinned:
            # torch.save of the copy names the device of the source, as a synchronous save's file does
            # (not for DCP's shards: tag False).
            _register_tagger()
            if tag:
                self._locations[buffer.data_ptr()] = torch.serialization.location_tag(source)
            else:
                self._locations.pop(buffer.data_ptr(), None)
            self._devices.add(source.device)
        buffer.copy_(source, non_blocking=pinned)
        self._used.append((key, buffer))
        self._staged[ident] = (source, buffer)
        return buffer

    def _free_pairs(self) -> list[tuple[_Key, torch.UntypedStorage]]:
        return [(key, storage) for key, storages in self._free.items() for storage in storages]

    def _drop(self, buffers: Iterable[tuple[_Key, torch.UntypedStorage]]) -> None:
        """Forget the location tags of these buffers (their memory goes when the last reference does)."""
        for (_, pinned), storage in buffers:
            if pinned:
                self._locations.pop(storage.data_ptr(), None)

__all__ = ["HostBuffers"]
