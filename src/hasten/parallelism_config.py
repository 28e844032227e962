"""Accelerate's ``accelerate.parallelism_config`` path: ``ParallelismConfig`` and its handlers.

The implementation is :mod:`hasten.config.parallelism` (pure sizes and checks, the one ``DeviceMesh``
builder, and ``resolve_parallelism_config``, which completes a run's config from the launch into a new
object); the N-D strategy that runs it is :mod:`hasten.strategies.nd`.

Example:
    >>> ParallelismConfig(dp_shard_size=4).total_size
    4
"""

from __future__ import annotations

from hasten._lazy import accelerate_path_getattr
from hasten.config.parallelism import ParallelismConfig, TorchContextParallelConfig, TorchTensorParallelConfig

__all__ = ["ParallelismConfig", "TorchContextParallelConfig", "TorchTensorParallelConfig"]

# Names Accelerate's module at this path shows but defines elsewhere (hasten/_accelerate_shown.py).
__getattr__ = accelerate_path_getattr(__name__, globals())
