"""Accelerate's ``ParallelismConfig``: the sizes of the device-mesh dimensions.

hasten runs one data-parallel dimension today: replicated (DDP, ``dp_replicate_size``) or sharded
(FSDP2, ``dp_shard_size``) over all processes. The other dimensions (tensor, context, sequence
parallel, and replicate × shard meshes) are refused with a ``ConfigurationError`` when the config is
built; they are tracked in hasten's N-D parallelism issue.

Example:
    >>> ParallelismConfig(dp_shard_size=4).total_size
    4
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from hasten.exceptions import ConfigurationError

_ND_ISSUE = ("hasten runs one data-parallel dimension today (DDP or FSDP2 over all processes); tensor, context and "
             "sequence parallelism and 2-D (replicate x shard) meshes are tracked in hasten's N-D parallelism issue")


def _sized(size: int | None) -> int:
    """A dimension's size: ``None`` means unused, i.e. 1 (``__post_init__`` has already replaced it)."""
    return 1 if size is None else size


@dataclass
class ParallelismConfig:
    """Sizes of the parallel dimensions (``-1``/``None`` = not used; 1 = trivially used).

    Args:
        dp_replicate_size: replicated data parallelism (DDP).
        dp_shard_size: sharded data parallelism (FSDP2).
        tp_size: tensor parallelism (refused when > 1).
        cp_size: context parallelism (refused when > 1).
        cp_backend: context-parallel backend (kept for compatibility).
        sp_size: sequence parallelism (refused when > 1).
        sp_backend: sequence-parallel backend (kept for compatibility).
        tp_handler: tensor-parallel settings object (kept for compatibility).
        cp_handler: context-parallel settings object (kept for compatibility).
        sp_handler: sequence-parallel settings object (kept for compatibility).
    """

    dp_replicate_size: int | None = None
    dp_shard_size: int | None = None
    tp_size: int | None = None
    cp_size: int | None = None
    cp_backend: str | None = None
    sp_size: int | None = None
    sp_backend: str | None = None
    tp_handler: Any = None
    cp_handler: Any = None
    sp_handler: Any = None

    def __post_init__(self) -> None:
        for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size"):
            value = getattr(self, name)
            value = 1 if value is None else value
            if not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"ParallelismConfig({name}={getattr(self, name)!r}): sizes are integers >= 1")
            setattr(self, name, value)
        for name in ("tp_size", "cp_size", "sp_size"):
            if getattr(self, name) > 1:
                raise ConfigurationError(f"ParallelismConfig({name}={getattr(self, name)}) is not supported: {_ND_ISSUE}.")
        if _sized(self.dp_replicate_size) > 1 and _sized(self.dp_shard_size) > 1:
            raise ConfigurationError(f"ParallelismConfig(dp_replicate_size={self.dp_replicate_size}, dp_shard_size="
                                     f"{self.dp_shard_size}) is a 2-D (HSDP) mesh, not supported: {_ND_ISSUE}.")

    @property
    def total_size(self) -> int:
        """Processes the mesh spans."""
        return self.data_parallel_size * self.non_data_parallel_size

    @property
    def non_data_parallel_size(self) -> int:
        """Product of the non-data-parallel dimensions (1 in hasten today)."""
        return _sized(self.tp_size) * _sized(self.cp_size) * _sized(self.sp_size)

    @property
    def data_parallel_size(self) -> int:
        """Product of the data-parallel dimensions."""
        return _sized(self.dp_replicate_size) * _sized(self.dp_shard_size)

    @property
    def dp_replicate_enabled(self) -> bool:
        return _sized(self.dp_replicate_size) > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return _sized(self.dp_shard_size) > 1

    @property
    def tp_enabled(self) -> bool:
        return _sized(self.tp_size) > 1

    @property
    def cp_enabled(self) -> bool:
        return _sized(self.cp_size) > 1

    @property
    def sp_enabled(self) -> bool:
        return _sized(self.sp_size) > 1

    @property
    def active_mesh_dims(self) -> list[str]:
        """Names of the dimensions larger than 1, outermost first."""
        return self.dp_dim_names + self.non_dp_dim_names

    @property
    def dp_dim_names(self) -> list[str]:
        return [n for n, on in (("dp_replicate", self.dp_replicate_enabled), ("dp_shard", self.dp_shard_enabled)) if on]

    @property
    def non_dp_dim_names(self) -> list[str]:
        return [n for n, on in (("cp", self.cp_enabled), ("sp", self.sp_enabled), ("tp", self.tp_enabled)) if on]

    @property
    def dp_shard_cp_dim_names(self) -> list[str]:
        return [n for n in ("dp_shard", "cp") if n in self.active_mesh_dims]

    @property
    def dp_cp_dim_names(self) -> list[str]:
        return [n for n in ("dp_replicate", "dp_shard", "cp") if n in self.active_mesh_dims]

    @property
    def fsdp_dim_names(self) -> list[str]:
        return [n for n in ("dp_shard", "cp", "sp") if n in self.active_mesh_dims]

    def _dims(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        names = self.active_mesh_dims or ["dp_shard"]
        sizes = {"dp_replicate": _sized(self.dp_replicate_size), "dp_shard": _sized(self.dp_shard_size)}
        return tuple(sizes.get(n, 1) for n in names), tuple(names)

    def build_device_mesh(self, device_type: str) -> Any:
        """A ``torch.distributed`` ``DeviceMesh`` of these sizes (the process group must be running)."""
        from torch.distributed.device_mesh import init_device_mesh

        shape, names = self._dims()
        return init_device_mesh(device_type, shape, mesh_dim_names=names)

    def get_device_mesh(self, device_type: str | None = None) -> Any:
        """The mesh, built on first use (``device_type`` defaults to this machine's: ``cuda`` or ``cpu``)."""
        if getattr(self, "_mesh", None) is None:
            import torch

            self._mesh = self.build_device_mesh(device_type or ("cuda" if torch.cuda.is_available() else "cpu"))
        return self._mesh

    def to_json(self) -> str:
        """The sizes and settings as JSON (handlers by class name)."""
        data = {k: (type(v).__name__ if k.endswith("_handler") and v is not None else v)
                for k, v in asdict(self).items()}
        return json.dumps(data)
