"""Data loading across processes: sharded, resumable, device-placing ``DataLoader`` subclasses.

Accelerate's names (``accelerate.data_loader``): ``prepare_data_loader``, ``skip_first_batches``,
``BatchSamplerShard``, ``IterableDatasetShard``, ``SeedableRandomSampler``, ``SkipBatchSampler``,
``SkipDataLoader``, ``DataLoaderShard``, ``DataLoaderDispatcher``, ``DataLoaderStateMixin``, plus
``gather_for_metrics``.
"""

from hasten.data.dispatch import DataLoaderDispatcher
from hasten.data.iterable import IterableDatasetShard
from hasten.data.loaders import (
    DataLoaderAdapter,
    DataLoaderShard,
    DataLoaderStateMixin,
    SkipDataLoader,
    get_sampler,
)
from hasten.data.metrics import gather_for_metrics
from hasten.data.prepare import prepare_data_loader, skip_first_batches
from hasten.data.samplers import BatchSamplerShard, SeedableRandomSampler, SkipBatchSampler

__all__ = [
    "BatchSamplerShard", "DataLoaderAdapter", "DataLoaderDispatcher", "DataLoaderShard", "DataLoaderStateMixin", "IterableDatasetShard",
    "SeedableRandomSampler", "SkipBatchSampler", "SkipDataLoader", "gather_for_metrics", "get_sampler", "prepare_data_loader",
    "skip_first_batches",
]
