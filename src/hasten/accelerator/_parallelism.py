"""The Accelerator's one parallelism mixin: ``parallelism_config``, ``torch_device_mesh``, the mesh ranks,
``maybe_context_parallel``; real on an N-D mesh, the one-dimensional answers without a ``ParallelismConfig``.

Data follows the mesh: ranks of one tensor/context-parallel group read the same batch, so data loaders
are sharded over the mesh's ``dp`` dimension only (:meth:`NDParallelismMixin._data_parallel_position`), and
``gather_for_metrics`` keeps what the ranks at coordinate 0 of every other dimension hold.

The layout has one path: :func:`resolve_layout` completes the user's ``ParallelismConfig`` into the
run's (a new object) before any group starts, and :func:`with_run_mesh` builds its mesh once, when
the group runs, onto that config, which the ``Accelerator`` hands to the strategy and to
``AcceleratorState``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from hasten.accelerator._base import AcceleratorBase
from hasten.base.dataclasses import DistributedType
from hasten.config.parallelism import resolve_parallelism_config
from hasten.devices import select_device
from hasten.environments import current_process_info
from hasten.runtime import process_group

#: The mesh dimensions along which ranks read different batches.
_DATA_PARALLEL_DIMS = ("dp_replicate", "dp_shard")


def resolve_layout(config: Any, launch: Any, cpu: bool) -> Any:
    """The run's ``ParallelismConfig`` (the user's is never changed), checked before any process group starts.

    ``config`` is completed by the config channel (:func:`~hasten.config.parallelism.resolve_parallelism_config`:
    sizes left unset from ``launch``'s ``parallelism_config`` block and Accelerate's ``PARALLELISM_CONFIG_*``
    variables; all 1s on several processes is DDP over all of them), then validated for this run.

    Raises:
        ConfigurationError: the sizes' product is not the number of processes, or a combination this
            device cannot run (see ``ParallelismConfig.validate``).
    """
    if config is None:
        return None
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
    else:
        world = current_process_info()[1].world_size
    block = launch.parallelism_config if launch is not None else None
    resolved = resolve_parallelism_config(config, launch_block=block, num_processes=world)
    resolved.validate(world, device_type=select_device(cpu=cpu).name)
    return resolved


def with_run_mesh(config: Any, device_type: str) -> Any:
    """The run's ``ParallelismConfig`` carrying its ``DeviceMesh``: built here, once per run, by the one builder
    (``config.build_device_mesh``), after the process group started and before the strategy exists.

    The strategy and ``AcceleratorState`` take the mesh from the returned config (a new object).
    ``config`` itself when there is nothing to lay out: no config, or one process and no group.
    """
    if config is None or not process_group.group_running():
        return config
    return dataclasses.replace(config, device_mesh=config.build_device_mesh(device_type))


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


__all__ = ["NDParallelismMixin", "data_parallel_leaders", "resolve_layout", "with_run_mesh"]
