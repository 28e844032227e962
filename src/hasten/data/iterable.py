"""``IterableDatasetShard``: each process keeps its slice of every group of samples of an iterable dataset."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset

from hasten.exceptions import ConfigurationError


class IterableDatasetShard(IterableDataset):
    """Wraps an ``IterableDataset`` so that this process yields only its share of the samples.

    Samples are read in groups of ``batch_size * num_processes`` (``batch_size`` with
    ``split_batches``); this process yields its contiguous slice of each group. Unless ``drop_last``,
    the final partial group is completed with samples from the first group, so every process yields the
    same number of samples, a multiple of its batch size. Same assignment as Accelerate.

    Args:
        dataset: the iterable dataset.
        batch_size: the per-process batch size, or the global one with ``split_batches``.
        drop_last: drop the final partial group instead of completing it.
        num_processes: number of processes.
        process_index: this process's index.
        split_batches: ``batch_size`` is the global batch size, to be split across processes.

    Example:
        >>> shard = IterableDatasetShard(range(8), batch_size=2, num_processes=2, process_index=1)
        >>> list(shard)
        [2, 3, 6, 7]

    Raises:
        ConfigurationError: ``split_batches`` with a batch size that ``num_processes`` does not divide.
    """

    def __init__(self, dataset: Any, batch_size: int = 1, drop_last: bool = False, num_processes: int = 1,
                 process_index: int = 0, split_batches: bool = False) -> None:
        if split_batches and batch_size > 1 and batch_size % num_processes != 0:
            raise ConfigurationError(
                f"To use `IterableDatasetShard` in `split_batches` mode, the batch size ({batch_size}) needs to be "
                f"a round multiple of the number of processes ({num_processes}).")
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        # Accelerate reads self.epoch before anyone set it (AttributeError); start at epoch 0 instead.
        self.epoch = 0
        self.last_group_size = -1

    def set_epoch(self, epoch: int) -> None:
        """Record the epoch and forward it to the dataset if it understands epochs."""
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    @property
    def generator(self) -> torch.Generator | None:
        """The wrapped dataset's generator, if it has one."""
        return getattr(self.dataset, "generator", None)

    @property
    def total_dataset_length(self) -> int:
        """Length of the wrapped dataset (all processes together)."""
        return len(self.dataset)

    def __len__(self) -> int:
        group = self.batch_size * self.num_processes
        if self.drop_last:
            return (len(self.dataset) // group) * self.batch_size
        return math.ceil(len(self.dataset) / group) * self.batch_size

    def __iter__(self) -> Iterator[Any]:
        generator = getattr(self.dataset, "generator", None)
        if not hasattr(self.dataset, "set_epoch") and isinstance(generator, torch.Generator):
            generator.manual_seed(self.epoch)
        group = self.batch_size if self.split_batches else self.batch_size * self.num_processes
        per_process = self.batch_size // self.num_processes if self.split_batches else self.batch_size
        lo, hi = self.process_index * per_process, (self.process_index + 1) * per_process
        self.last_group_size = -1  # known once the stream ends (see DataLoaderShard.remainder)
        first: list[Any] | None = None
        current: list[Any] = []
        for element in self.dataset:
            current.append(element)
            if len(current) == group:
                yield from current[lo:hi]
                if first is None:
                    first = current
                current = []
        self.last_group_size = len(current) if not self.drop_last else -1
        if self.drop_last or not current:
            return
        filler = first if first is not None else list(current)
        while len(current) < group:
            current += filler
        yield from current[lo:hi]
