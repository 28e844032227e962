"""Prepared data loaders: ``DataLoaderShard`` (each process reads its own batches) and ``SkipDataLoader``.

Both are real ``torch.utils.data.DataLoader`` subclasses, so ``isinstance(loader, DataLoader)`` holds.
What hasten adds over Accelerate:

* **Resumable**: ``state_dict()`` / ``load_state_dict()`` hold the epoch, the shuffling generators' state
  at the start of that epoch (uint8 tensors: loadable with ``torch.load(weights_only=True)``) and the
  number of batches already yielded; after ``load_state_dict`` the next pass yields exactly the batches
  the interrupted pass had left, in the same order. Map-style loaders skip at the index level (no data
  is loaded for skipped batches).
* **One-shot skips**: ``skip_batches`` / :func:`~hasten.data.skip_first_batches` affect the next pass
  only (Accelerate skips on every pass).
* **No per-epoch collectives and no global RNG draws while iterating**: the shuffling generator is
  agreed across processes once, when the loader is prepared (see ``hasten.data.prepare``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from hasten.data.samplers import batches_after, offsets_samples
from hasten.data.saved_state import check_saved_fields, length_of
from hasten.exceptions import ConfigurationError
from hasten.ops import send_to_device, synchronize_rng_states
from hasten.ops.tree import find_batch_size
from hasten.runtime.preemption import PREEMPTION as _PREEMPTION
from hasten.state import GradientState

_STATE_VERSION = 2  # 2: samples_yielded, num_processes, global_batch_size


def make_mover(device: torch.device | str | int | None, non_blocking: bool = False) -> Callable[[Any], Any] | None:
    """A function moving a batch to ``device`` that returns it untouched when it is already there.

    The common cases (a tensor, or a tuple/list/dict of tensors) are checked in a tight loop, which
    costs a fraction of a generic tree walk on every batch.
    """
    if device is None:
        return None
    target = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if target.type != "cpu" and target.index is None:
        return lambda data: send_to_device(data, target, non_blocking=non_blocking)

    tensor = torch.Tensor
    if target.type == "cpu":
        def move(data: Any) -> Any:
            kind = type(data)
            if kind is tensor and data.is_cpu:
                return data
            if kind is tuple or kind is list or kind is dict:
                for leaf in (data.values() if kind is dict else data):
                    if type(leaf) is not tensor or not leaf.is_cpu:
                        break
                else:
                    return data
            return send_to_device(data, target, non_blocking=non_blocking)
        return move

    def move_to_accelerator(data: Any) -> Any:
        kind = type(data)
        if kind is tensor and data.device == target:
            return data
        if kind is tuple or kind is list or kind is dict:
            for leaf in (data.values() if kind is dict else data):
                if type(leaf) is not tensor or leaf.device != target:
                    break
            else:
                return data
        return send_to_device(data, target, non_blocking=non_blocking)

    return move_to_accelerator


class _SkipOnce:
    """The batches of ``base`` after the first ``skip`` (used for one pass; C-level islice)."""

    def __init__(self, base: Iterable[Any], skip: int) -> None:
        self.base, self.skip = base, skip

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # torch's stub names its private iterator
        return itertools.islice(iter(self.base), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.base) - self.skip)  # type: ignore[arg-type]


class _OffsetOnce:
    """The batches of ``base`` for a pass that starts ``samples`` indices into the epoch (one pass)."""

    def __init__(self, base: Any, samples: int) -> None:
        self.base, self.samples = base, samples

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        return batches_after(self.base, self.samples)

    def __len__(self) -> int:
        return len(self.base)  # an upper bound; torch uses it only for warnings about workers


class _IndexSkipMixin:
    """Lets a map-style loader start its next pass ``n`` batches (or samples) in, without loading them."""

    _skip_in_iterator = 0
    _offset_in_iterator = 0

    @property
    def _index_sampler(self) -> Any:
        base = self.batch_sampler if self.batch_sampler is not None else self.sampler  # type: ignore[attr-defined]
        if self._offset_in_iterator:
            return _OffsetOnce(base, self._offset_in_iterator)
        skip = self._skip_in_iterator
        return _SkipOnce(base, skip) if skip else base

    def _offsets_samples(self) -> bool:
        """Whether the next pass can start at any sample of the epoch (map-style, plain batch sampler)."""
        base = self.batch_sampler if self.batch_sampler is not None else self.sampler  # type: ignore[attr-defined]
        return self._skips_indices() and offsets_samples(base)

    def _skips_indices(self) -> bool:
        # A persistent worker pool keeps the index sampler it was created with for every later pass, so
        # a one-pass wrapper must never reach it: such loaders skip by discarding data instead.
        persistent = self.persistent_workers and self.num_workers > 0  # type: ignore[attr-defined]
        return not isinstance(self.dataset, IterableDataset) and not persistent  # type: ignore[attr-defined]

    def _open_iterator(self, skip: int, offset: int = 0) -> tuple[Iterator[Any], int]:
        """The base iterator for a pass and how many batches are still to be discarded from it.

        ``offset`` (samples into the epoch's order) is only ever set where :meth:`_offsets_samples` holds.
        """
        index_skip = skip if skip and self._skips_indices() else 0
        self._skip_in_iterator = index_skip
        self._offset_in_iterator = offset
        try:
            iterator = DataLoader.__iter__(self)  # type: ignore[arg-type]
        finally:
            self._skip_in_iterator = 0
            self._offset_in_iterator = 0
        return iterator, skip - index_skip


class DataLoaderStateMixin:
    """Tracks the pass in progress: ``end_of_dataloader``, ``remainder``, and registration with
    ``GradientState`` (``gather_for_metrics`` and gradient accumulation read them).

    ``remainder`` is ``len(dataset) % total_batch_size`` (-1 when unknown or with ``drop_last``): the
    number of real samples in the last global batch.
    """

    end_of_dataloader: bool = False
    remainder: int = -1

    def reset(self) -> None:
        """Forget the end-of-pass markers."""
        self.end_of_dataloader = False
        self.remainder = -1

    def begin(self) -> None:
        """Start a pass: compute ``remainder`` and become the active loader of ``GradientState``."""
        self.reset()
        if not self._drop_last:  # type: ignore[attr-defined]
            try:
                length = getattr(self.dataset, "total_dataset_length", None) or len(self.dataset)  # type: ignore[attr-defined]
                self.remainder = length % self.total_batch_size  # type: ignore[attr-defined]
            except (TypeError, ZeroDivisionError, AttributeError):
                self.remainder = -1
        self.gradient_state._add_dataloader(self)  # type: ignore[attr-defined]

    def end(self) -> None:
        """End a pass: stop being the active loader."""
        self.gradient_state._remove_dataloader(self)  # type: ignore[attr-defined]


class ResumableMixin:
    """Epoch counter, generator snapshots and position in the pass: the state for exact resume.

    The position is saved twice: ``batches_yielded`` (this process's batches, the unit of a resume on
    the same layout) and ``samples_yielded``, the number of samples of the epoch's global order the
    whole run has used (batches x global batch size). A resume on another number of processes, or
    with another per-process batch size, starts the pass at that global sample (see
    :meth:`check_state_dict`).
    """

    iteration: int = 0
    _progress: list[int] = [0]  # batches of the current pass handed out (a list: see _start_pass)
    _pending_skip: int = 0
    _pending_offset: int = 0  # samples into the epoch's order where the next pass starts
    _pass_offset: int = 0
    _native_shards: int | None = None  # set by prepare for file-sharded streams (no global order)
    _pass_token: object | None = None
    _start_states: list[torch.Tensor] | None = None

    @property
    def base_dataloader(self) -> Any:
        """The loader producing the batches: every hasten loader is its own (Accelerate's wrap one)."""
        return self

    def _init_resume(self, iteration: int, skip_batches: int) -> None:
        self.iteration = iteration
        self._pending_skip = int(skip_batches)
        self._pending_offset = 0
        self._pass_offset = 0
        self._progress = [0]
        self._pass_token = None
        self._start_states = None

    def _generators(self) -> list[torch.Generator]:
        """Every generator whose state decides this loader's order (deduplicated)."""
        candidates = [getattr(self, "generator", None), getattr(self, "synchronized_generator", None)]
        batch_sampler = getattr(self, "batch_sampler", None)
        for owner in (getattr(self, "sampler", None), batch_sampler, getattr(batch_sampler, "batch_sampler", None)):
            inner = getattr(owner, "sampler", None)
            candidates += [getattr(owner, "generator", None), getattr(inner, "generator", None)]
        candidates.append(getattr(getattr(self, "dataset", None), "generator", None))
        found: list[torch.Generator] = []
        for gen in candidates:
            if isinstance(gen, torch.Generator) and all(gen is not g for g in found):
                found.append(gen)
        return found

    def _start_pass(self) -> tuple[object, int]:
        skip, self._pending_skip = self._pending_skip, 0
        self._pass_offset, self._pending_offset = self._pending_offset, 0
        token = object()
        self._pass_token = token
        self._start_states = [g.get_state() for g in self._generators()]
        # A fresh one-element list, bumped in place per batch: setting an attribute on a DataLoader goes
        # through its Python-level __setattr__, too slow for the per-batch path.
        self._progress = [skip]
        return token, skip

    def _finish_pass(self, token: object) -> None:
        if self._pass_token is token:
            self.iteration += 1
            self._progress = [0]
            self._pass_offset = 0
            self._pass_token = None

    def _close_pass(self, token: object) -> None:
        # Each pass registered the loader once; an abandoned pass (``break``) is closed here too.
        self.end()  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ layout, for the global position
    def _data_processes(self) -> int:
        """How many processes share this loader's epoch (the data-parallel degree it was sharded for)."""
        if self._native_shards is not None:
            return self._native_shards
        for owner in (getattr(self, "batch_sampler", None), getattr(self, "sampler", None),
                      getattr(self, "dataset", None)):
            count = getattr(owner, "num_processes", None)
            if isinstance(count, int):
                return count
        return 1

    def _global_batch_size(self) -> int | None:
        """Samples of the epoch's order one batch of every process uses (None: not a fixed number)."""
        if self._native_shards is not None:
            return None  # file shards per process: no global order to count in
        try:
            size = self.total_batch_size if hasattr(self, "total_batch_size") else self.batch_size  # type: ignore[attr-defined]
            return int(size) if size else None
        except (TypeError, ValueError, AttributeError):
            return None

    def _offsets_samples(self) -> bool:
        return False

    def _resume_point(self, state: dict[str, Any]) -> tuple[int, int]:
        """``(batches to skip, samples to skip)`` for the next pass from a saved position.

        Raises:
            ValueError: the position cannot be mapped onto this loader's layout (message says why).
        """
        batches = int(state.get("batches_yielded", 0))
        samples, saved_n = state.get("samples_yielded"), state.get("num_processes")
        size, n = self._global_batch_size(), self._data_processes()
        if samples is not None and size is not None:
            samples = int(samples)
            if samples % size == 0:
                return samples // size, 0
            if self._offsets_samples():
                return 0, samples
            raise ValueError(
                f"this data loader was saved {samples} samples into its epoch, which its global batch size of "
                f"{size} does not divide, and it cannot start a pass in the middle of a batch (only map-style "
                "loaders with a plain batch sampler and no persistent workers can). Keep the global batch size "
                f"(per-process batch x processes) at {state.get('global_batch_size', 'the saved one')}, or resume "
                "from a checkpoint saved at an epoch boundary.")
        if not batches or saved_n is None or int(saved_n) == n:
            return batches, 0  # same layout (or an older state that names none: the caller checks the count)
        raise ValueError(
            f"this data loader was saved by {saved_n} processes {batches} batches into an epoch, but its batches "
            f"have no fixed global size, so the position does not map onto {n} processes. Resume with {saved_n} "
            "processes, or from a checkpoint saved at an epoch boundary.")

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands: epoch, generator states at the epoch's start, position in the pass.

        The position is ``batches_yielded`` (this process's batches) and, when the global batch size is
        fixed, ``samples_yielded`` (samples of the epoch's global order used by all processes together),
        with ``num_processes`` and ``global_batch_size``. Everything is an int or a uint8 tensor, so
        ``torch.load(weights_only=True)`` reads it back.

        Example:
            >>> state = loader.state_dict()   # e.g. in the middle of an epoch
            >>> fresh.load_state_dict(state)  # fresh's next pass yields the batches that were left
        """
        in_pass = self._pass_token is not None
        states = self._start_states if in_pass and self._start_states is not None else \
            [g.get_state() for g in self._generators()]
        batches = int(self._progress[0] if in_pass else self._pending_skip)
        state: dict[str, Any] = {"version": _STATE_VERSION, "epoch": int(self.iteration), "batches_yielded": batches,
                                 "generator_states": [s.clone() for s in states],
                                 "num_processes": self._data_processes()}
        size = self._global_batch_size()
        if size is not None:
            offset = self._pass_offset if in_pass else self._pending_offset
            state["global_batch_size"] = size
            state["samples_yielded"] = int(offset + batches * size)
        return state

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Raise ``ValueError`` unless :meth:`load_state_dict` would accept ``state_dict`` (every field in
        range, :func:`~hasten.data.saved_state.check_saved_fields`); changes nothing."""
        check_saved_fields(state_dict, self._generators(), version=_STATE_VERSION,
                           batches_per_process=length_of(self), global_batch_size=self._global_batch_size())
        self._resume_point(state_dict)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output: the next pass continues where the saved one stopped.

        A state saved with another number of processes or another per-process batch size continues at
        the same sample of the epoch's global order (``samples_yielded``).

        Raises:
            ValueError: the state holds a different number of generators than this loader has, or a
                position this loader's layout cannot start at (:meth:`check_state_dict`).
        """
        self.check_state_dict(state_dict)
        skip, offset = self._resume_point(state_dict)
        for gen, state in zip(self._generators(), state_dict.get("generator_states", [])):
            gen.set_state(torch.as_tensor(state, dtype=torch.uint8).clone())
        self._pass_token = None
        self._start_states = None
        self.set_epoch(int(state_dict.get("epoch", 0)))  # type: ignore[attr-defined]
        self._pending_skip = skip
        self._pending_offset = offset

    def adjust_state_dict_for_prefetch(self) -> None:
        """Nothing to adjust: the state counts batches handed to the loop, never ones read ahead."""

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the next pass and forward it to whatever understands epochs."""
        self.iteration = epoch
        batch_sampler: Any = getattr(self, "batch_sampler", None)
        sampler = getattr(self, "sampler", None)
        if isinstance(sampler, BatchSampler):  # a batch sampler passed as `sampler`
            batch_sampler = sampler
        inner: Any = getattr(batch_sampler, "sampler", None)
        nested: Any = getattr(getattr(batch_sampler, "batch_sampler", None), "sampler", None)
        if hasattr(batch_sampler, "set_epoch"):
            batch_sampler.set_epoch(epoch)
        elif hasattr(inner, "set_epoch"):
            inner.set_epoch(epoch)
        elif hasattr(nested, "set_epoch"):
            nested.set_epoch(epoch)
        elif hasattr(getattr(self, "dataset", None), "set_epoch"):
            self.dataset.set_epoch(epoch)  # type: ignore[attr-defined]


def _check_unsupported(use_stateful_dataloader: bool, torch_device_mesh: Any) -> None:
    if use_stateful_dataloader:
        raise ConfigurationError(
            "use_stateful_dataloader=True is not supported: hasten's prepared loaders are resumable without "
            "torchdata (state_dict()/load_state_dict(), saved by Accelerator.save_state). HINT: drop the flag.")
    if torch_device_mesh is not None:
        raise ConfigurationError("torch_device_mesh (tensor/context-parallel data sharding) is not supported yet; "
                                 "pass torch_device_mesh=None.")


class DataLoaderShard(_IndexSkipMixin, ResumableMixin, DataLoaderStateMixin, DataLoader):
    """A ``DataLoader`` that moves batches to a device and tracks the end of each pass.

    It reads one batch ahead, so ``end_of_dataloader`` is already True while the last batch is being
    processed. During a pass it is the active loader of ``GradientState``.

    Args:
        dataset: the dataset.
        device: where to put each batch (None: leave it).
        rng_types: generators to synchronise from process 0: ``"torch"``/``"cuda"`` at the start of every
            pass (the user asked for it), ``"generator"`` (the shuffling generator) once, before the first
            pass, unless the loader was prepared (then it was agreed at prepare time).
        synchronized_generator: the shuffling generator.
        skip_batches: batches to skip at the start of the next pass only.
        use_stateful_dataloader: must be False (hasten loaders are resumable without torchdata).
        _drop_last: the original loader's ``drop_last`` (no remainder is then reported).
        _non_blocking: asynchronous device copies.
        torch_device_mesh: must be None.
        iteration: the epoch of the next pass.
        **kwargs: ``torch.utils.data.DataLoader`` arguments.

    Example:
        >>> loader = DataLoaderShard(list(range(8)), batch_size=4)
        >>> [loader.end_of_dataloader for _ in loader]
        [False, True]
    """

    def __init__(self, dataset: Any, device: torch.device | None = None, rng_types: list[Any] | None = None,
                 synchronized_generator: torch.Generator | None = None, skip_batches: int = 0,
                 use_stateful_dataloader: bool = False, _drop_last: bool = False, _non_blocking: bool = False,
                 torch_device_mesh: Any = None, iteration: int = 0, **kwargs: Any) -> None:
        _check_unsupported(use_stateful_dataloader, torch_device_mesh)
        super().__init__(dataset, **kwargs)
        self.device = device
        self.rng_types = rng_types
        self.synchronized_generator = synchronized_generator
        self.skip_batches = skip_batches
        self.use_stateful_dataloader = False
        self.torch_device_mesh = None
        self.gradient_state = GradientState()
        self._drop_last = _drop_last
        self._non_blocking = _non_blocking
        self._generator_agreed = False
        self._global_base_seed = False  # prepare_data_loader sets it (see the module docstring of prepare.py)
        self._init_resume(iteration, skip_batches)

    def _sync_rngs(self) -> None:
        types = [str(getattr(t, "value", t)) for t in (self.rng_types or [])]
        per_pass = [t for t in types if t != "generator"]
        if per_pass:
            synchronize_rng_states(per_pass)
        if "generator" in types and self.synchronized_generator is not None and not self._generator_agreed:
            synchronize_rng_states(["generator"], self.synchronized_generator)
            self._generator_agreed = True

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # torch's stub names its private iterator
        self._sync_rngs()
        token, skip = self._start_pass()
        progress = self._progress
        try:
            self.begin()
            self.set_epoch(self.iteration)
            if self._global_base_seed and not skip and not self._pass_offset:
                # Accelerate's torch DataLoader draws this pass's base seed from the global RNG here: the same
                # draw keeps the user's stream (dropout) equal. A resumed pass does not: the uninterrupted run
                # drew before the checkpoint's RNG snapshot.
                torch.empty((), dtype=torch.int64).random_()
            iterator, data_skip = self._open_iterator(skip, self._pass_offset)
            # Hot path, one generator level: read one batch ahead so `end_of_dataloader` is set before the
            # last batch is handed out; move each batch as soon as it is read (overlaps async copies).
            current = next(iterator, _END)
            for _ in range(data_skip):
                current = next(iterator, _END)
            if current is not _END:
                move = make_mover(self.device, self._non_blocking)
                if move is not None:
                    current = move(current)
                for upcoming in iterator:
                    if _PREEMPTION.save_due:  # preemption: checkpoint before this batch is handed out
                        _PREEMPTION.at_boundary()
                    progress[0] += 1
                    yield current
                    current = move(upcoming) if move is not None else upcoming
                self._mark_end()
                if _PREEMPTION.save_due:
                    _PREEMPTION.at_boundary()
                progress[0] += 1
                yield current
            self._finish_pass(token)
        finally:
            self._close_pass(token)

    def _mark_end(self) -> None:
        self.end_of_dataloader = True
        if self.remainder == -1 and not self._drop_last and self.num_workers == 0:
            # A stream without a length: the shard counted the real samples of its last group.
            self.remainder = getattr(self.dataset, "last_group_size", -1)

    @property
    def total_batch_size(self) -> int:
        """The global batch size: per-process size x processes (the original size with split_batches)."""
        if isinstance(self.dataset, IterableDataset):
            # Read the shard itself: the default batch sampler torch builds here knows only one process.
            shard: Any = self.dataset
            if hasattr(shard, "num_processes") and hasattr(shard, "split_batches"):
                return int(shard.batch_size) * (1 if shard.split_batches else int(shard.num_processes))
            return int(self.batch_size or 1)
        sampler: Any = self.sampler if isinstance(self.sampler, BatchSampler) else self.batch_sampler
        if getattr(sampler, "split_batches", False):
            return int(sampler.batch_size)
        return int(sampler.batch_size) * int(getattr(sampler, "num_processes", 1))

    @property
    def total_dataset_length(self) -> int:
        """Length of the whole dataset (all processes)."""
        return int(getattr(self.dataset, "total_length", None) or len(self.dataset))  # type: ignore[arg-type]

    def get_sampler(self) -> Any:
        """The index sampler inside the (sharded) batch sampler."""
        return _sampler_of(self)

    def set_sampler(self, sampler: Any) -> None:
        """Replace the index sampler inside the (sharded) batch sampler."""
        owner: Any = self.sampler if isinstance(self.sampler, BatchSampler) else self.batch_sampler
        owner.sampler = sampler


_END = object()


def _sampler_of(loader: DataLoader) -> Any:
    owner = loader.sampler if isinstance(loader.sampler, BatchSampler) else loader.batch_sampler
    return getattr(owner, "sampler", None)


class DataLoaderAdapter(_IndexSkipMixin, ResumableMixin, DataLoader):
    """A plain ``DataLoader`` with the resumable state of hasten's loaders (Accelerate's common base).

    ``state_dict()`` / ``load_state_dict()`` record the epoch, the shuffling generators' states at the
    start of the pass and the batches handed out, so a restored loader continues the interrupted pass
    with the same order.

    Args:
        dataset: the dataset.
        use_stateful_dataloader: must be False (hasten loaders are resumable without torchdata).
        batch_sampler: a batch sampler (as for ``DataLoader``).
        **kwargs: ``torch.utils.data.DataLoader`` arguments.
    """

    def __init__(self, dataset: Any, use_stateful_dataloader: bool = False, batch_sampler: Any = None,
                 **kwargs: Any) -> None:
        _check_unsupported(use_stateful_dataloader, None)
        super().__init__(dataset, batch_sampler=batch_sampler, **kwargs)
        self.use_stateful_dataloader = False
        self._init_resume(0, 0)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # torch's stub names its private iterator
        token, skip = self._start_pass()
        progress = self._progress
        iterator, data_skip = self._open_iterator(skip, self._pass_offset)
        for _ in range(data_skip):
            if next(iterator, _END) is _END:
                break
        for batch in iterator:
            progress[0] += 1
            yield batch
        self._finish_pass(token)


class SkipDataLoader(DataLoaderAdapter, DataLoaderStateMixin):
    """A ``DataLoader`` whose next pass starts ``skip_batches`` batches in; later passes are whole.

    (Accelerate's skips on every pass.) Map-style datasets skip indices without loading data; the
    loader is resumable like its siblings (``state_dict`` / ``load_state_dict``).

    Example:
        >>> loader = SkipDataLoader(list(range(16)), batch_size=4, skip_batches=2)
        >>> [b.tolist() for b in loader]
        [[8, 9, 10, 11], [12, 13, 14, 15]]
        >>> len(list(loader))
        4
    """

    def __init__(self, dataset: Any, skip_batches: int = 0, use_stateful_dataloader: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(dataset, use_stateful_dataloader=use_stateful_dataloader, **kwargs)
        self.skip_batches = skip_batches
        self._init_resume(0, skip_batches)
        self.gradient_state = GradientState()
        self._drop_last = bool(self.drop_last)

    @property
    def total_batch_size(self) -> int:
        return int(self.batch_size or 1)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        # Accelerate's SkipDataLoader is the active loader of GradientState while it is iterated
        self.begin()
        try:
            yield from super().__iter__()
        finally:
            self.end()


def get_sampler(dataloader: DataLoader) -> Any:
    """The index sampler of a loader (inside its batch sampler, sharded or not)."""
    return _sampler_of(dataloader)


def batch_size_of(batch: Any) -> int:
    """First-dimension size of a batch (for the dispatcher and metrics)."""
    size = find_batch_size(batch)
    return 0 if size is None else size
