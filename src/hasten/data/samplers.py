"""Samplers that shard a data loader across processes: ``BatchSamplerShard``, ``SeedableRandomSampler``,
``SkipBatchSampler``.

The index assignment is Accelerate's, table for table (see ``tests/data/test_data_samplers.py``). For the
common case (a plain ``torch.utils.data.BatchSampler`` over a sequential or random sampler) the indices
of a whole epoch are drawn at once and this process's batches are cut out of them by slicing, instead
of walking every index of every process through Python generators; the result is the same list of
batches, and the sampler's generator is consumed exactly as a full pass of the original would.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

from hasten.exceptions import ConfigurationError


class SeedableRandomSampler(RandomSampler):
    """A ``RandomSampler`` whose order depends only on ``(seed, epoch)``.

    The seed is ``data_seed`` when given, else ``torch.initial_seed()`` (what ``set_seed`` set). Each pass
    reseeds the generator with ``seed + epoch`` and, at its end, moves to the next epoch; ``set_epoch(e)``
    replays epoch ``e`` exactly, on every process.

    Accepts ``RandomSampler``'s arguments (``data_source, replacement=False, num_samples=None,
    generator=None``) plus the keyword-only ``data_seed`` (default ``torch.initial_seed()``).

    Example:
        >>> sampler = SeedableRandomSampler(range(8), data_seed=3)
        >>> sampler.set_epoch(1); first = list(sampler)
        >>> sampler.set_epoch(1); first == list(sampler)
        True
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        data_seed = kwargs.pop("data_seed", None)
        super().__init__(*args, **kwargs)
        self.initial_seed = int(data_seed) if data_seed is not None else torch.random.initial_seed()
        self.epoch = 0

    def _seed_generator(self) -> None:
        if self.generator is None:
            self.generator = torch.Generator()
        self.generator.manual_seed(self.initial_seed + self.epoch)

    def __iter__(self) -> Iterator[int]:
        self._seed_generator()
        yield from super().__iter__()
        self.set_epoch(self.epoch + 1)

    def _epoch_indices(self) -> list[int]:
        """The whole pass at once (same indices and epoch bookkeeping as a full ``__iter__``)."""
        self._seed_generator()
        indices = _random_indices(self)
        self.set_epoch(self.epoch + 1)
        return indices

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose order the next pass yields."""
        self.epoch = epoch


def _random_indices(sampler: RandomSampler) -> list[int]:
    """What a full pass of ``RandomSampler.__iter__`` yields, drawn with the same generator calls."""
    n = len(sampler.data_source)
    generator = sampler.generator
    num_samples = sampler.num_samples
    if n == 0:
        return []
    out: list[int] = []
    for _ in range(num_samples // n):
        out += torch.randperm(n, generator=generator).tolist()
    tail = torch.randperm(n, generator=generator)  # drawn even when unused, as RandomSampler does
    if num_samples % n:
        out += tail[: num_samples % n].tolist()
    return out


def epoch_indices(sampler: Iterable[int]) -> list[int]:
    """All indices of one pass of ``sampler``, with a vectorised path for torch's own samplers."""
    kind = type(sampler)
    if kind is SequentialSampler:
        return list(range(len(sampler.data_source)))  # type: ignore[attr-defined]
    if kind is SeedableRandomSampler and not sampler.replacement:  # type: ignore[attr-defined]
        return sampler._epoch_indices()  # type: ignore[attr-defined]
    if kind is RandomSampler and not sampler.replacement and sampler.generator is not None:  # type: ignore[attr-defined]
        return _random_indices(sampler)  # type: ignore[arg-type]
    return list(sampler)


# ------------------------------------------------------------------------------ index assignment
def _pad_source(first_batches: Sequence[Sequence[int]], needed: int) -> list[int]:
    data = [i for batch in first_batches for i in batch]
    if not data:
        return data
    while len(data) < needed:  # degenerate: fewer samples than one full round
        data += data
    return data


def _tail_no_split(pending: list[Any], last: list[int], first: Sequence[Sequence[int]], idx: int,
                   batch_size: int | None, n: int, rank: int, even: bool) -> Iterator[list[int]]:
    """The end of a pass without splitting: ``pending`` is this rank's unyielded batch (or [])."""
    if not even:
        if pending:
            yield pending
        return
    if batch_size is None:  # variable-size batches: pad with whole batches of the first round
        if pending:
            yield pending
        idx += 1
        cycle = 0
        while idx % n != 0:
            if idx % n == rank:
                yield list(first[cycle % len(first)])
            cycle += 1
            idx += 1
        return
    if len(pending) == batch_size:
        yield pending
    initial = _pad_source(first, n * batch_size)
    batch: list[int] = [] if len(last) == batch_size else list(last)
    if not batch:
        idx += 1
    cycle = 0
    while idx % n != 0 or batch:
        end = cycle + batch_size - len(batch)
        batch = batch + initial[cycle:end]
        if idx % n == rank:
            yield batch
        cycle = end
        batch = []
        idx += 1


def iter_no_split(batches: Iterable[list[int]], n: int, rank: int, batch_size: int | None, drop_last: bool,
                  even: bool) -> Iterator[list[int]]:
    """Batch ``i`` goes to rank ``i % n``; a round is released once it is complete and its last batch full."""
    first: list[list[int]] = []
    pending: list[int] = []
    idx, batch = -1, list[int]()
    for idx, batch in enumerate(batches):
        if not drop_last and idx < n:
            first.append(batch)
        if idx % n == rank:
            pending = batch
        if idx % n == n - 1 and (batch_size is None or len(batch) == batch_size):
            yield pending
            pending = []
    if drop_last or not first:
        return
    yield from _tail_no_split(pending, batch, first, idx, batch_size, n, rank, even)


def iter_split(batches: Iterable[list[int]], n: int, rank: int, batch_size: int, drop_last: bool,
               even: bool, head: list[int] | None = None) -> Iterator[list[int]]:
    """Every full batch is cut into ``n`` contiguous pieces; piece ``rank`` is this process's batch.

    ``head`` is the epoch's first batch when ``batches`` start later in the epoch (the padding source).
    """
    piece = batch_size // n
    lo, hi = piece * rank, piece * (rank + 1)
    first: list[int] = list(head) if head is not None else []
    batch: list[int] = []
    for idx, batch in enumerate(batches):
        if idx == 0 and head is None:
            first = list(batch)
        if len(batch) == batch_size:
            yield batch[lo:hi]
    if drop_last or not first or not batch or len(batch) >= batch_size:
        return
    if not even:
        if len(batch) > lo:
            yield batch[lo:hi]
        return
    padded = list(batch) + _pad_source([first], batch_size)
    yield padded[lo:hi]


def _chunks(indices: list[int], batch_size: int, drop_last: bool) -> list[list[int]]:
    stop = len(indices) - len(indices) % batch_size if drop_last else len(indices)
    return [indices[i:i + batch_size] for i in range(0, stop, batch_size)]


def _rank_batches_fast(indices: list[int], n: int, rank: int, batch_size: int, drop_last: bool,
                       even: bool, head: list[int] | None = None) -> list[list[int]]:
    """:func:`iter_no_split` over the chunks of ``indices``, touching only this rank's full rounds.

    ``head`` is the whole epoch's order when ``indices`` is its tail (a resumed pass): the padding of
    an uneven end comes from the epoch's first batches, as in the uninterrupted pass.
    """
    total = len(indices) // batch_size if drop_last else -(-len(indices) // batch_size)
    last_full = total > 0 and (drop_last or len(indices) % batch_size == 0)
    rounds = total // n
    if rounds and total % n == 0 and not last_full:
        rounds -= 1  # the final round ends with a short batch: it is handled by the tail
    step = n * batch_size
    start = rank * batch_size
    out = [indices[start + r * step:start + r * step + batch_size] for r in range(rounds)]
    if drop_last or total == 0:
        return out
    done = rounds * n
    rest = [indices[i * batch_size:(i + 1) * batch_size] for i in range(done, total)]
    source = indices if head is None else head
    first = [source[i * batch_size:(i + 1) * batch_size] for i in range(min(n, -(-len(source) // batch_size)))]
    pending = rest[rank] if rank < len(rest) else []
    out.extend(_tail_no_split(pending, rest[-1] if rest else [], first, total - 1, batch_size, n, rank, even)
               if rest else [])
    return out


class BatchSamplerShard(BatchSampler):
    """Wraps a batch sampler so that this process sees only its share of the batches.

    Without ``split_batches``, batch ``i`` goes to process ``i % num_processes``; with it, each batch is
    cut into ``num_processes`` pieces. With ``even_batches`` (the default) the end is padded with indices
    from the start so that every process gets the same number of full batches; a batch sampler with
    ``drop_last`` drops the incomplete final round instead. Identical to Accelerate's assignment.

    Args:
        batch_sampler: the batch sampler to shard (anything iterable over lists of indices).
        num_processes: number of processes.
        process_index: this process's index.
        split_batches: split each batch across processes instead of dealing out whole batches.
        even_batches: pad the end so every process gets the same number of batches.

    Example:
        >>> shard = BatchSamplerShard(BatchSampler(range(8), 2, False), num_processes=2, process_index=1)
        >>> list(shard)
        [[2, 3], [6, 7]]

    Raises:
        ConfigurationError: ``split_batches`` with a batch size that ``num_processes`` does not divide,
            or with a batch sampler that has no batch size.
    """

    def __init__(self, batch_sampler: Iterable[list[int]], num_processes: int = 1, process_index: int = 0,
                 split_batches: bool = False, even_batches: bool = True) -> None:
        batch_size: Any = getattr(batch_sampler, "batch_size", None)
        if split_batches and batch_size is None:
            raise ConfigurationError(
                f"split_batches=True needs a batch sampler with a `batch_size`; {type(batch_sampler).__name__} has "
                "none. HINT: use split_batches=False for batch samplers with variable batch sizes.")
        if split_batches and batch_size % num_processes != 0:
            raise ConfigurationError(
                f"To use `BatchSamplerShard` in `split_batches` mode, the batch size ({batch_size}) needs to be a "
                f"round multiple of the number of processes ({num_processes}). HINT: pick a batch size divisible "
                f"by {num_processes}, or use split_batches=False.")
        # BatchSampler.__init__ is not called on purpose: it validates a sampler we do not have.
        self.batch_sampler = batch_sampler
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.batch_size = batch_size
        self.drop_last = bool(getattr(batch_sampler, "drop_last", False))

    @property
    def sampler(self) -> Any:
        """The sampler inside the wrapped batch sampler (None if it has none); settable."""
        return getattr(self.batch_sampler, "sampler", None)

    @sampler.setter
    def sampler(self, value: Any) -> None:
        self.batch_sampler.sampler = value  # type: ignore[attr-defined]

    @property
    def total_length(self) -> int:
        """Number of batches of the wrapped batch sampler (all processes together)."""
        return len(self.batch_sampler)  # type: ignore[arg-type]

    def __len__(self) -> int:
        total = len(self.batch_sampler)  # type: ignore[arg-type]
        if self.split_batches:
            return total
        length, extra = divmod(total, self.num_processes)
        if extra == 0 or self.drop_last:
            return length
        if self.even_batches:
            return length + 1
        return length + 1 if self.process_index < extra else length

    def set_epoch(self, epoch: int) -> None:
        """Forward the epoch to the wrapped batch sampler, or else to its sampler."""
        if hasattr(self.batch_sampler, "set_epoch"):
            self.batch_sampler.set_epoch(epoch)
        elif hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        return self.iter_after(0)

    def iter_after(self, samples: int) -> Iterator[list[int]]:
        """This process's batches of a pass that starts ``samples`` indices into the epoch's order.

        ``samples`` > 0 needs a plain ``BatchSampler`` with a fixed batch size inside (see
        :func:`offsets_samples`): the remaining indices are dealt out as a fresh pass would, and an
        uneven end is padded from the epoch's first indices, as the uninterrupted pass pads it.
        """
        inner = self.batch_sampler
        n, rank, size = self.num_processes, self.process_index, self.batch_size
        if type(inner) is BatchSampler and isinstance(size, int):
            # Whole epoch at once; lazily, so the generator is consumed when the first batch is asked for,
            # exactly when the original batch sampler would consume it.
            indices = epoch_indices(inner.sampler)
            rest, head = (indices[samples:], indices) if samples else (indices, None)
            if self.split_batches:
                yield from iter_split(_chunks(rest, size, self.drop_last), n, rank, size, self.drop_last,
                                      self.even_batches, head=head[:size] if head is not None else None)
            else:
                yield from _rank_batches_fast(rest, n, rank, size, self.drop_last, self.even_batches, head=head)
            return
        if samples:
            raise ValueError(f"{type(inner).__name__} cannot start a pass {samples} samples in (only a plain "
                             "BatchSampler with a batch size can)")
        if self.split_batches:
            yield from iter_split(inner, n, rank, size, self.drop_last, self.even_batches)  # type: ignore[arg-type]
        else:
            yield from iter_no_split(inner, n, rank, size, self.drop_last, self.even_batches)


def offsets_samples(batch_sampler: Any) -> bool:
    """Whether :func:`batches_after` can start a pass of ``batch_sampler`` at any sample of the epoch."""
    inner = batch_sampler.batch_sampler if isinstance(batch_sampler, BatchSamplerShard) else batch_sampler
    return (type(inner) is BatchSampler and isinstance(getattr(inner, "batch_size", None), int)
            and not isinstance(inner.sampler, BatchSampler))  # indices, not batches, inside


def batches_after(batch_sampler: Any, samples: int) -> Iterator[list[int]]:
    """The batches of a pass of ``batch_sampler`` that starts ``samples`` indices into the epoch's order.

    Used to resume on another number of processes when the global batch size does not divide the
    samples already used; the generator is consumed exactly as by a whole pass.
    """
    if isinstance(batch_sampler, BatchSamplerShard):
        return batch_sampler.iter_after(samples)
    indices = epoch_indices(batch_sampler.sampler)[samples:]
    return iter(_chunks(indices, batch_sampler.batch_size, batch_sampler.drop_last))


class SkipBatchSampler(BatchSampler):
    """A batch sampler that leaves out the first ``skip_batches`` batches of another one.

    Example:
        >>> list(SkipBatchSampler(BatchSampler(range(8), 2, False), skip_batches=3))
        [[6, 7]]
    """

    def __init__(self, batch_sampler: Iterable[list[int]], skip_batches: int = 0) -> None:
        self.batch_sampler = batch_sampler
        self.skip_batches = skip_batches
        self.batch_size: Any = getattr(batch_sampler, "batch_size", None)
        self.drop_last = getattr(batch_sampler, "drop_last", False)

    @property
    def sampler(self) -> Any:  # type: ignore[override]
        """The sampler inside the wrapped batch sampler (None if it has none)."""
        return getattr(self.batch_sampler, "sampler", None)

    def __iter__(self) -> Iterator[list[int]]:
        # islice runs in C: skipped batches cost only their index lists, never a data load.
        return itertools.islice(iter(self.batch_sampler), self.skip_batches, None)

    @property
    def total_length(self) -> int:
        """Length of the wrapped batch sampler."""
        return len(self.batch_sampler)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.skip_batches)  # type: ignore[arg-type]
