"""Accelerate's ``accelerate.parallelism_config`` path: ``ParallelismConfig`` and its handlers.

The implementation is :mod:`hasten.config.parallelism` (sizes, validation, the ``DeviceMesh``); the
N-D strategy that runs it is :mod:`hasten.strategies.nd`.

Example:
    >>> ParallelismConfig(dp_shard_size=4).total_size
    4
"""

from __future__ import annotations

from hasten.config.parallelism import ParallelismConfig, TorchContextParallelConfig, TorchTensorParallelConfig

__all__ = ["ParallelismConfig", "TorchContextParallelConfig", "TorchTensorParallelConfig"]
