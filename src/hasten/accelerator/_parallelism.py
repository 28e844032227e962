"""The Accelerator's one parallelism mixin: ``parallelism_config``, ``torch_device_mesh``, the mesh ranks,
``maybe_context_parallel``; real on an N-D mesh, the one-dimensional answers without a ``ParallelismConfig``.

Data follows the mesh: ranks of one tensor/context-parallel group read the same batch, so data loaders
are sharded over the mesh's ``dp`` dimension only (:meth:`NDParallelismMixin._data_parallel_position`), and
``gather_for_metrics`` keeps what the ranks at coordinate 0 of every other dimension hold.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from hasten.accelerator._base import AcceleratorBase
from hasten.base.dataclasses import DistributedType
from hasten.connector import uses_nd_strategy
from hasten.devices import select_device
from hasten.environments import current_process_info

#: The mesh dimensions along which ranks read different batches.
_DATA_PARALLEL_DIMS = ("dp_replicate", "dp_shard")


def check_parallelism_sizes(config: Any, cpu: bool) -> None:
    """Refuse a ``ParallelismConfig`` this run cannot use, before the process group is started.

    Raises:
        ConfigurationError: the sizes' product is not the number of processes, or a combination this
            device cannot run (see ``ParallelismConfig.validate``).
    """
    if config is None:
        return
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
    else:
        world = current_process_info()[1].world_size
    if config.total_size == 1 and world > 1:  # as in Accelerate: no sizes on several processes is DDP over all
        config._set_size("dp_replicate", world)
    config.validate(world, device_type=select_device(cpu=cpu).name)


def build_mesh(config: Any, strategy: Any) -> Any:
    """The run's named ``DeviceMesh`` (None without a ``ParallelismConfig``, or with one process and no group)."""
    if config is None:
        return None
    if uses_nd_strategy(config):
        return strategy.world_mesh
    if not dist.is_initialized():
        return None
    return config.build_device_mesh(strategy.device.type)


def data_parallel_leaders(mesh: Any) -> list[int]:
    """The global ranks at coordinate 0 of every non-data-parallel dimension of ``mesh``, in ``dp`` order.

    Example:
        >>> data_parallel_leaders(mesh)  # mesh (dp_shard=2, tp=2) over ranks [[0, 1], [2, 3]] -> [0, 2]
    """
    names = mesh.mesh_dim_names or ()
    index = tuple(slice(None) if name in _DATA_PARALLEL_DIMS else 0 for name in names)
    return [int(rank) for rank in mesh.mesh[index].flatten().tolist()]


class NDParallelismMixin(AcceleratorBase):
    """Accelerate's N-D members, real when a ``ParallelismConfig`` is given (else the one-dimensional answers)."""

    @property
    def parallelism_config(self) -> Any:
        """The run's ``ParallelismConfig`` (None when not given)."""
        return self._settings.parallelism_config

    @property
    def torch_device_mesh(self) -> Any:
        """The ``DeviceMesh`` named ``("dp_replicate", "dp_shard", "cp", "tp")`` (active dimensions), or None.

        Flattened views: ``mesh["dp"]`` (every data-parallel rank), ``mesh["dp_shard_cp"]``, ``mesh["dp_cp"]``
        where they span more than one dimension.
        """
        return self.state.device_mesh

    def _mesh_rank(self, dim: str, enabled: bool, without_config: int) -> int:
        """This process's index along mesh dimension ``dim`` (0 when it is not in use), as Accelerate answers;
        ``without_config`` is the one-dimensional answer."""
        if self._settings.parallelism_config is None:
            return without_config
        mesh = self.torch_device_mesh
        return int(mesh.get_local_rank(dim)) if enabled and mesh is not None else 0

    @property
    def is_composable_parallelism_enabled(self) -> bool:
        """True when data parallelism is composed with sharding or tensor/context parallelism on a mesh."""
        config = self._settings.parallelism_config
        return config is not None and (config.dp_shard_enabled or config.tp_enabled or config.cp_enabled)

    @property
    def data_parallel_rank(self) -> int:
        """Index along ``dp_replicate`` (Accelerate's meaning; 0 without replication)."""
        config = self._settings.parallelism_config
        return self._mesh_rank("dp_replicate", config is not None and config.dp_replicate_enabled, self.process_index)

    @property
    def data_parallel_shard_rank(self) -> int:
        """Index along ``dp_shard`` (0 without sharding; the global rank under FSDP2 without a config)."""
        config = self._settings.parallelism_config
        sharded = self.process_index if self._strategy.distributed_type == DistributedType.FSDP else 0
        return self._mesh_rank("dp_shard", config is not None and config.dp_shard_enabled, sharded)

    @property
    def tensor_parallel_rank(self) -> int:
        """Index along ``tp`` (0 without tensor parallelism)."""
        config = self._settings.parallelism_config
        return self._mesh_rank("tp", config is not None and config.tp_enabled, 0)

    @property
    def context_parallel_rank(self) -> int:
        """Index along ``cp`` (0 without context parallelism)."""
        config = self._settings.parallelism_config
        return self._mesh_rank("cp", config is not None and config.cp_enabled, 0)

    def _data_parallel_position(self) -> tuple[int, int]:
        """``(data-parallel size, this process's data-parallel rank)`` for sharding batches: the mesh's ``dp``."""
        mesh = self.torch_device_mesh
        if self._settings.parallelism_config is None or mesh is None:
            return self.num_processes, self.process_index
        dp = mesh["dp"]
        return int(dp.size()), int(dp.get_local_rank())

    def _metrics_sources(self) -> list[int] | None:
        """The global ranks whose results ``gather_for_metrics`` keeps, in data-parallel order: one per
        ``dp`` rank (coordinate 0 on every other mesh dimension); None keeps every process's."""
        mesh = self.torch_device_mesh
        if self._settings.parallelism_config is None or mesh is None:
            return None
        return data_parallel_leaders(mesh)

    @contextlib.contextmanager
    def maybe_context_parallel(self, buffers: list[torch.Tensor] | None = None,
                               buffer_seq_dims: list[int] | None = None,
                               no_restore_buffers: set[torch.Tensor] | None = None) -> Iterator[None]:
        """Split ``buffers`` along their sequence dimension over the ``cp`` ranks for the block (CP runs only).

        Without context parallelism this does nothing. With it, PyTorch's ``context_parallel`` shards
        the buffers in place (load-balanced) and makes ``scaled_dot_product_attention`` ring over the
        ``cp`` ranks; buffers are restored afterwards except those in ``no_restore_buffers``.
        """
        config = self._settings.parallelism_config
        if config is None or not config.cp_enabled:
            yield
            return
        from torch.distributed.tensor.experimental import context_parallel

        from hasten._private_api import set_rotate_method

        set_rotate_method(config.cp_handler.cp_comm_strategy)
        with context_parallel(self.torch_device_mesh["cp"], buffers=buffers, buffer_seq_dims=buffer_seq_dims,
                              no_restore_buffers=no_restore_buffers):
            yield


__all__ = ["NDParallelismMixin", "build_mesh", "check_parallelism_sizes", "data_parallel_leaders"]
