"""``DataLoaderDispatcher``: process 0 reads every batch, broadcasts it, each process keeps its slice.

Useful when the data can only be read once (a stream) or reading is expensive. Works on gloo and NCCL:
the batch's layout travels with ``broadcast_object_list`` and its tensors with ``broadcast``. Unlike
Accelerate, non-tensor leaves (strings from a ``collate_fn``...) are carried along unchanged instead of
failing, and only process 0 creates the underlying iterator (no idle worker processes elsewhere).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.utils.data import DataLoader

from hasten.data.loaders import DataLoaderStateMixin, ResumableMixin, _check_unsupported, batch_size_of
from hasten.exceptions import ConfigurationError
from hasten.ops import broadcast, broadcast_object_list, send_to_device
from hasten.ops.tree import honor_type, slice_tensors
from hasten.runtime.preemption import PREEMPTION as _PREEMPTION
from hasten.state import GradientState, PartialState


@dataclass(frozen=True)
class _TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


def _describe(data: Any) -> Any:
    """The batch with each tensor replaced by its shape and dtype (non-tensor leaves kept as they are)."""
    if isinstance(data, torch.Tensor):
        return _TensorSpec(tuple(data.shape), data.dtype)
    if isinstance(data, (list, tuple)):
        return honor_type(data, (_describe(d) for d in data))
    if isinstance(data, Mapping):
        return cast(Any, type(data))({k: _describe(v) for k, v in data.items()})
    return data


def _allocate(spec: Any, device: torch.device) -> Any:
    if isinstance(spec, _TensorSpec):
        return torch.empty(spec.shape, dtype=spec.dtype, device=device)
    if isinstance(spec, (list, tuple)):
        return honor_type(spec, (_allocate(s, device) for s in spec))
    if isinstance(spec, Mapping):
        return cast(Any, type(spec))({k: _allocate(v, device) for k, v in spec.items()})
    return spec


def _concat(batches: list[Any]) -> Any:
    """Concatenate same-structured batches on dim 0; a non-tensor leaf is taken from the first batch."""
    first = batches[0]
    if isinstance(first, torch.Tensor):
        try:
            return torch.cat(batches, dim=0)
        except RuntimeError as exc:
            shapes = [tuple(b.shape) for b in batches]
            raise ConfigurationError(
                f"dispatch_batches=True needs batches whose shapes differ only in the first dimension, got {shapes}. "
                "HINT: pass dispatch_batches=False so each process reads its own batches, or split_batches=True "
                "so process 0 reads one batch and splits it.") from exc
    if isinstance(first, (list, tuple)):
        return honor_type(first, (_concat([b[i] for b in batches]) for i in range(len(first))))
    if isinstance(first, Mapping):
        return cast(Any, type(first))({k: _concat([b[k] for b in batches]) for k in first})
    return first


class DataLoaderDispatcher(ResumableMixin, DataLoaderStateMixin, DataLoader):
    """A ``DataLoader`` iterated on process 0 only; each batch is broadcast and sliced per process.

    Without ``split_batches`` process 0 reads ``num_processes`` batches and concatenates them; with it,
    one batch, cut in ``num_processes`` pieces. A final partial round is split as evenly as possible and,
    when the samples do not divide, padded with samples of the first batch (``remainder`` is then the
    number of real samples in it, so ``gather_for_metrics`` drops exactly the padding).

    Args:
        dataset: the dataset.
        split_batches: split each batch instead of dealing out whole batches.
        skip_batches: batches to skip at the start of the next pass only.
        use_stateful_dataloader: must be False.
        _drop_last: the original loader's ``drop_last``.
        _non_blocking: asynchronous device copies.
        slice_fn: ``slice_fn(batch, slice, process_index=..., num_processes=...)`` cuts a process's share
            (default: slice every tensor on dim 0).
        torch_device_mesh: must be None.
        iteration: the epoch of the next pass.
        **kwargs: ``torch.utils.data.DataLoader`` arguments.

    Example:
        >>> loader = DataLoaderDispatcher(list(range(8)), batch_size=2)  # 2 processes: rank 1 gets [2, 3], [6, 7]
    """

    def __init__(self, dataset: Any, split_batches: bool = False, skip_batches: int = 0,
                 use_stateful_dataloader: bool = False, _drop_last: bool = False, _non_blocking: bool = False,
                 slice_fn: Callable[..., Any] | None = None, torch_device_mesh: Any = None, iteration: int = 0,
                 **kwargs: Any) -> None:
        _check_unsupported(use_stateful_dataloader, torch_device_mesh)
        super().__init__(dataset, **kwargs)
        self.split_batches = split_batches
        self.skip_batches = skip_batches
        self.use_stateful_dataloader = False
        self.torch_device_mesh = None
        self.gradient_state = GradientState()
        self.state = PartialState()
        self._drop_last = _drop_last
        self._non_blocking = _non_blocking
        self.slice_fn = slice_fn
        self._init_resume(iteration, skip_batches)

    # ------------------------------------------------------------------------------ process 0 side
    def _read_round(self, iterator: Iterator[Any] | None) -> Any:
        """Process 0: the next concatenated batch, or None at the end (partial rounds kept unless drop_last)."""
        assert iterator is not None
        wanted = 1 if self.split_batches else self.state.num_processes
        batches = []
        for _ in range(wanted):
            batch = next(iterator, _END)
            if batch is _END:
                break
            batches.append(batch)
        if not batches or (len(batches) < wanted and self._drop_last):
            return None
        return batches[0] if len(batches) == 1 else _concat(batches)

    def _exchange(self, iterator: Iterator[Any] | None) -> Any:
        """Every process: the next full (unsliced) batch on the device, or None when the pass is over."""
        device = self.state.device
        if self.state.process_index == 0:
            batch = self._read_round(iterator)
            info = [None if batch is None else _describe(batch)]
        else:
            batch, info = None, [None]
        broadcast_object_list(info)
        if info[0] is None:
            return None
        if self.state.process_index == 0:
            batch = send_to_device(batch, device, non_blocking=self._non_blocking)
        else:
            batch = _allocate(info[0], device)
        if self.state.num_processes > 1:
            # In place, leaf by leaf; non-tensor leaves already travelled with the layout.
            broadcast(_tensor_leaves(batch), from_process=0)
        return batch

    def _slice(self, batch: Any, part: slice) -> Any:
        if self.slice_fn is None:
            return slice_tensors(batch, part)
        return self.slice_fn(batch, part, process_index=self.state.process_index,
                             num_processes=self.state.num_processes)

    # ------------------------------------------------------------------------------ every process
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # torch's stub names its private iterator
        token, skip = self._start_pass()
        try:
            self.begin()
            self.set_epoch(self.iteration)
            iterator = DataLoader.__iter__(self) if self.state.process_index == 0 else None
            yield from self._dispatch(iterator, skip)
            self._finish_pass(token)
        finally:
            self._close_pass(token)

    def _dispatch(self, iterator: Iterator[Any] | None, skip: int) -> Iterator[Any]:
        n, rank = self.state.num_processes, self.state.process_index
        first = None
        index = 0
        upcoming = self._exchange(iterator)
        while upcoming is not None:
            batch = upcoming
            if first is None and not self._drop_last:
                first = self._slice(batch, slice(0, n))  # kept to pad an uneven final round
            upcoming = self._exchange(iterator)
            observed = batch_size_of(batch)
            size = observed // n
            if upcoming is None:
                if not self._drop_last and observed % n != 0:
                    batch = _concat([batch, first])
                    size += 1
                self.end_of_dataloader = True
                self.remainder = observed
            part = self._slice(batch, slice(rank * size, (rank + 1) * size))
            index += 1
            if index > skip:  # resuming: the skipped batches are still read so padding stays identical
                if _PREEMPTION.save_due:  # preemption: checkpoint before this batch is handed out
                    _PREEMPTION.at_boundary()
                self._progress[0] = index
                yield part

    def __len__(self) -> int:
        whole = super().__len__()
        if self.split_batches:
            return whole
        if self._drop_last:
            return whole // self.state.num_processes
        return math.ceil(whole / self.state.num_processes)

    def _data_processes(self) -> int:
        return int(self.state.num_processes)

    @property
    def total_batch_size(self) -> int:
        """The global batch size."""
        size = int(self.batch_size or getattr(self.batch_sampler, "batch_size", 1) or 1)
        return size if self.split_batches else size * self.state.num_processes

    @property
    def total_dataset_length(self) -> int:
        """Length of the dataset."""
        return len(self.dataset)  # type: ignore[arg-type]

    def get_sampler(self) -> Any:
        """The index sampler inside the batch sampler."""
        return getattr(self.batch_sampler, "sampler", None)

    def set_sampler(self, sampler: Any) -> None:
        """Replace the index sampler inside the batch sampler."""
        owner: Any = self.batch_sampler
        owner.sampler = sampler


_END = object()


def _tensor_leaves(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, (list, tuple)):
        return [t for b in batch for t in _tensor_leaves(b)]
    if isinstance(batch, Mapping):
        return [t for v in batch.values() for t in _tensor_leaves(v)]
    return []
