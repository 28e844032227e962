"""Range checks of a saved data loader state, before any of its numbers is used.

A state comes back from a checkpoint file, so every number in it is checked against what a loader of
this layout can mean by it: counters are integers >= 0, the position lies inside the epoch, process
counts and batch sizes are positive and bounded, and each generator state has the size of the generator
it is restored into. A bad value raises ``ValueError`` naming the field and the value (the checkpoint
manager adds the file), before anything changed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

import torch

#: Bounds far above any real run, below what would overflow or size anything.
MAX_PROCESSES = 1 << 20
MAX_COUNT = 1 << 62
MAX_EPOCH = 1 << 32


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _show(value: Any) -> str:
    return repr(value) if _is_int(value) else f"{repr(value)[:40]} ({type(value).__name__})"


def _check_range(state: Mapping[str, Any], field: str, low: int, high: int, meaning: str) -> None:
    if field not in state:
        return
    value = state[field]
    if not _is_int(value) or not low <= value <= high:
        raise ValueError(f"field {field!r} = {_show(value)} is not {meaning} (an integer from {low} to {high})")


def length_of(loader: Any) -> int | None:
    """Batches per process in a pass of ``loader`` (None when its dataset has no length)."""
    try:
        return int(len(loader))
    except (TypeError, NotImplementedError, AttributeError, ValueError):
        return None


def check_saved_fields(state: Mapping[str, Any], generators: Sequence[torch.Generator], *, version: int,
                       batches_per_process: int | None, global_batch_size: int | None) -> None:
    """Raise ``ValueError`` unless every field of ``state`` is in range for this loader.

    Args:
        state: what ``state_dict()`` saved.
        generators: this loader's generators, in the order the state lists theirs.
        version: the newest state version this hasten writes.
        batches_per_process: ``len(loader)`` on this layout (None: unknown, e.g. a stream).
        global_batch_size: samples one batch of every process uses on this layout (None: not fixed).
    """
    _check_generator_states(state.get("generator_states", []), generators)
    _check_range(state, "version", 1, version, "a data loader state version this hasten reads")
    _check_range(state, "epoch", 0, MAX_EPOCH, "an epoch")
    _check_range(state, "num_processes", 1, MAX_PROCESSES, "a process count")
    _check_range(state, "global_batch_size", 1, MAX_COUNT, "a batch size")
    _check_range(state, "batches_yielded", 0, MAX_COUNT, "a batch count")
    _check_range(state, "samples_yielded", 0, MAX_COUNT, "a sample count")
    samples, batches = state.get("samples_yielded"), state.get("batches_yielded", 0)
    if batches_per_process is not None and global_batch_size is not None and samples is not None:
        # The saved layout may pad its last global batch; this bound is loose by up to one batch of
        # either layout (and a dropped tail), never tight enough to refuse a genuine position.
        saved_size = state.get("global_batch_size", global_batch_size)
        limit = (batches_per_process + 1) * global_batch_size + saved_size
        if samples > limit:
            raise ValueError(f"field 'samples_yielded' = {samples} lies beyond the end of the epoch (this loader's "
                             f"epoch holds about {batches_per_process * global_batch_size} samples)")
    elif batches_per_process is not None and batches > batches_per_process:
        raise ValueError(f"field 'batches_yielded' = {batches} lies beyond the end of the epoch (this loader yields "
                         f"{batches_per_process} batches per epoch)")


def _check_generator_states(states: Any, generators: Sequence[torch.Generator]) -> None:
    if not isinstance(states, (list, tuple)):
        raise ValueError(f"field 'generator_states' is a {type(states).__name__}, not a list of generator states")
    if len(states) != len(generators):
        raise ValueError(
            f"This data loader state holds {len(states)} generator state(s) but the loader has "
            f"{len(generators)} generator(s): prepare the same kind of loader (shuffled or not, same sampler) "
            "before loading its state.")
    for i, (saved, generator) in enumerate(zip(states, generators)):
        size = generator.get_state().numel()
        if not isinstance(saved, torch.Tensor) or saved.dtype != torch.uint8 or saved.dim() != 1 \
                or saved.numel() != size:
            found = (f"a {saved.dtype} tensor of shape {tuple(saved.shape)}" if isinstance(saved, torch.Tensor)
                     else f"a {type(saved).__name__}")
            raise ValueError(f"field 'generator_states'[{i}] is {found}, not the state of a {generator.device} "
                             f"generator (a uint8 tensor of {size} bytes)")


__all__ = ["MAX_COUNT", "MAX_EPOCH", "MAX_PROCESSES", "check_saved_fields", "length_of"]
