"""``ParallelismConfig``: the sizes of an N-D run (pipeline x replicate x shard x context x tensor) and its
``DeviceMesh``.

Accelerate's fields and dimension names, plus hasten's pipeline ones (``pp_size``, ``pp_schedule``,
``pp_microbatches``, ``pp_split_points``). The mesh is laid out ``("pp", "dp_replicate", "dp_shard", "cp",
"tp")`` with the dimensions of size 1 left out, so tensor-parallel ranks are neighbours (fastest link) and
pipeline stages, which exchange only activations, are outermost (slowest link). Flattened views are added under Accelerate's names:
``"dp"`` (replicate x shard: the data-parallel ranks), ``"dp_shard_cp"`` (what FSDP shards over) and
``"dp_cp"`` (the ranks gradients are averaged over).

Everything here is arithmetic on sizes, checked before any process group starts, except
:meth:`ParallelismConfig.build_device_mesh`, the one builder of a hasten ``DeviceMesh``.

A ``ParallelismConfig`` is pure: it holds what its caller gave (sizes left ``None`` read 1) and
checks it; it never reads the environment and no method changes it. What the launch adds (``hasten
launch --parallelism_config_*``, Accelerate's ``PARALLELISM_CONFIG_*`` variables, "all 1s on several
processes is DDP") is applied by :func:`resolve_parallelism_config`, which returns a new config.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, overload

from hasten._private_api import flatten_mesh
from hasten.exceptions import ConfigurationError

#: Mesh dimensions, outermost first.
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
#: Tensor-parallel styles a plan may name (``ParallelStyle`` objects are accepted too).
TP_STYLES = ("colwise", "rowwise", "sequence_parallel", "replicate")
_SIZE_FIELDS = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size", "pp_size")
#: What the launch may fill in where the caller gave None.
_FILLABLE = (*_SIZE_FIELDS, "cp_backend", "sp_backend", "tp_handler", "cp_handler", "pp_schedule", "pp_microbatches",
             "pp_split_points")
#: Pipeline schedules (torch.distributed.pipelining's class for each name).
PP_SCHEDULES = {"GPipe": "ScheduleGPipe", "1F1B": "Schedule1F1B", "Interleaved1F1B": "ScheduleInterleaved1F1B",
                "LoopedBFS": "ScheduleLoopedBFS", "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble",
                "ZBVZeroBubble": "ScheduleZBVZeroBubble", "DualPipeV": "ScheduleDualPipeV"}
#: The schedules that run several stages per process, and how they place stages on processes: "loop"
#: (process r holds stages r, r + pp_size, ...) or "v" (process r holds r and 2 * pp_size - 1 - r).
PP_MULTI_STAGE = {"Interleaved1F1B": "loop", "LoopedBFS": "loop", "InterleavedZeroBubble": "loop",
                  "ZBVZeroBubble": "v", "DualPipeV": "v"}


@dataclass
class TorchTensorParallelConfig:
    """Tensor-parallel settings (``ParallelismConfig(tp_handler=...)``).

    Args:
        enable_async_tp: Accelerate's switch for asynchronous TP (CUDA only; refused elsewhere).
        tp_plan: hasten's plain plan for any PyTorch model: module-name patterns (``*`` matches one
            name component, ``nn.Sequential`` children are their indices) to ``"colwise"``,
            ``"rowwise"``, ``"sequence_parallel"``, ``"replicate"`` or a ``ParallelStyle`` object.
            When ``None``, the model's own transformers plan (``_tp_plan`` / ``base_model_tp_plan``) is used.

    Example:
        >>> TorchTensorParallelConfig(tp_plan={"layers.*.q_proj": "colwise", "layers.*.o_proj": "rowwise"})
    """

    enable_async_tp: bool = False
    tp_plan: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.tp_plan is None:
            return
        if not isinstance(self.tp_plan, Mapping) or not self.tp_plan:
            raise ConfigurationError(f"tp_plan must be a non-empty dict of module-name pattern -> style, got "
                                     f"{self.tp_plan!r}; e.g. {{'0': 'colwise', '2': 'rowwise'}}.")
        for pattern, style in self.tp_plan.items():
            if isinstance(style, str) and style not in TP_STYLES:
                raise ConfigurationError(f"tp_plan[{pattern!r}] = {style!r} is not a tensor-parallel style: use one "
                                         f"of {TP_STYLES} or a torch.distributed.tensor.parallel.ParallelStyle.")
            if not isinstance(style, str) and not _is_parallel_style(style):
                raise ConfigurationError(f"tp_plan[{pattern!r}] is a {type(style).__name__}: give a style name "
                                         f"{TP_STYLES} or a ParallelStyle object.")


@dataclass
class TorchContextParallelConfig:
    """Context-parallel settings (``ParallelismConfig(cp_handler=...)``).

    Args:
        cp_comm_strategy: how attention exchanges keys/values: ``"allgather"`` or ``"alltoall"``.
    """

    cp_comm_strategy: str = "allgather"

    def __post_init__(self) -> None:
        if self.cp_comm_strategy not in ("allgather", "alltoall"):
            raise ConfigurationError(f"Invalid cp_comm_strategy: {self.cp_comm_strategy}. Must be one of 'allgather' "
                                     "or 'alltoall'.")


@dataclass
class ParallelismConfig:
    """How the processes of a run are arranged: Accelerate's ``ParallelismConfig`` (same fields, same order).

    Pure: sizes left ``None`` read 1 here, and the object never changes afterwards. The run fills
    them from ``hasten launch --parallelism_config_*`` (or the config file's ``parallelism_config``
    block) and Accelerate's ``PARALLELISM_CONFIG_*`` variables through
    :func:`resolve_parallelism_config`, into a new config (``accelerator.parallelism_config``).
    The sizes' product must equal the number of processes; all 1 on several processes means DDP
    over all of them.

    Args:
        dp_replicate_size: full replicas (DDP, or the replicate dimension of HSDP).
        dp_shard_size: processes each replica is sharded over (FSDP2).
        tp_size: tensor-parallel degree.
        cp_size: context-parallel degree (sequence split; CUDA only).
        cp_backend: ``"torch"`` (the only context-parallel backend).
        sp_size: DeepSpeed-Ulysses sequence parallelism: not available in hasten (refused above 1).
        sp_backend: ``"deepspeed"`` (kept for compatibility).
        tp_handler: :class:`TorchTensorParallelConfig` (hasten adds its ``tp_plan``).
        cp_handler: :class:`TorchContextParallelConfig`.
        sp_handler: kept for compatibility (``sp_size`` is refused above 1).
        pp_size: pipeline processes (hasten). Composes with ``dp_replicate_size``, ``dp_shard_size`` (each
            stage sharded with FSDP2) and ``tp_size`` (on each stage's modules).
        pp_schedule: ``"GPipe"``, ``"1F1B"`` (default), or a schedule with several stages per process:
            ``"Interleaved1F1B"``, ``"LoopedBFS"``, ``"InterleavedZeroBubble"`` (stages placed round-robin),
            ``"ZBVZeroBubble"``, ``"DualPipeV"`` (two stages per process, placed in a V).
        pp_microbatches: micro-batches per batch (default ``pp_size``; at least ``pp_size``).
        pp_split_points: module names where stages 1.. begin: ``pp_size - 1`` of them for one stage per
            process, ``pp_size * k - 1`` for ``k`` stages per process.

    Example:
        >>> config = ParallelismConfig(dp_shard_size=2, tp_size=2)
        >>> config.total_size, config.active_mesh_dims
        (4, ['dp_shard', 'tp'])
    """

    dp_replicate_size: int | None = None
    dp_shard_size: int | None = None
    tp_size: int | None = None
    cp_size: int | None = None
    cp_backend: str | None = None
    sp_size: int | None = None
    sp_backend: str | None = None
    tp_handler: TorchTensorParallelConfig | None = None
    cp_handler: TorchContextParallelConfig | None = None
    sp_handler: Any = None
    pp_size: int | None = None
    pp_schedule: str | None = None
    pp_microbatches: int | None = None
    pp_split_points: list[str] | None = None
    #: The run's mesh: set only on the config the ``Accelerator`` resolves (``accelerator.parallelism_config``).
    device_mesh: Any = field(default=None, repr=False, compare=False)
    #: The fields the caller left ``None`` (what :func:`resolve_parallelism_config` may fill in).
    _unset: frozenset[str] = field(init=False, repr=False, compare=False, default=frozenset())

    def __post_init__(self) -> None:
        self._unset = frozenset(name for name in _FILLABLE if getattr(self, name) is None)
        for name in _SIZE_FIELDS:
            value = getattr(self, name)
            value = 1 if value is None else value
            if isinstance(value, bool) or not isinstance(value, int) and not str(value).isdigit():
                raise ConfigurationError(f"ParallelismConfig {name}={value!r} must be a positive integer.")
            if int(value) < 1:
                raise ConfigurationError(f"ParallelismConfig {name}={value} must be at least 1.")
            setattr(self, name, int(value))
        self.cp_backend = self.cp_backend or "torch"
        self.sp_backend = self.sp_backend or "deepspeed"
        if self.cp_backend != "torch":
            raise ConfigurationError(f"cp_backend={self.cp_backend!r}: the only context-parallel backend is 'torch'.")
        if (self.sp_size or 1) > 1:
            raise ConfigurationError(
                f"sp_size={self.sp_size}: DeepSpeed-Ulysses sequence parallelism is not available in hasten. Split "
                "long sequences with context parallelism (cp_size, on CUDA) instead, or use sp_size=1.")
        if (self.tp_size or 1) > 1 and self.tp_handler is None:
            self.tp_handler = TorchTensorParallelConfig()
        if (self.cp_size or 1) > 1 and self.cp_handler is None:
            self.cp_handler = TorchContextParallelConfig()
        self._check_pipeline()
        if self.tp_handler is not None and not isinstance(self.tp_handler, TorchTensorParallelConfig):
            raise ConfigurationError(f"tp_handler must be a TorchTensorParallelConfig, got {type(self.tp_handler).__name__}.")
        if self.cp_handler is not None and not isinstance(self.cp_handler, TorchContextParallelConfig):
            raise ConfigurationError(f"cp_handler must be a TorchContextParallelConfig, got {type(self.cp_handler).__name__}.")

    def _check_pipeline(self) -> None:
        """Normalise and check the pipeline fields (``pp_size`` is already a checked integer)."""
        schedule = self.pp_schedule or "1F1B"
        schedule = schedule.removeprefix("Schedule") if schedule.removeprefix("Schedule") in PP_SCHEDULES else schedule
        if schedule not in PP_SCHEDULES:
            raise ConfigurationError(f"pp_schedule={self.pp_schedule!r} is not a pipeline schedule: use one of "
                                     f"{sorted(PP_SCHEDULES)}.")
        self.pp_schedule = schedule
        chunks: Any = self.pp_microbatches
        if chunks is not None:  # left None, it follows pp_size (also when the launch fills pp_size in later)
            if isinstance(chunks, bool) or not isinstance(chunks, int) and not str(chunks).isdigit() or int(chunks) < 1:
                raise ConfigurationError(f"ParallelismConfig pp_microbatches={chunks!r} must be a positive integer.")
            self.pp_microbatches = int(chunks)
        if self.pipeline_microbatches < self.pp_size:  # type: ignore[operator]
            raise ConfigurationError(
                f"pp_microbatches={self.pp_microbatches} is fewer than pp_size={self.pp_size} stages: every stage needs "
                f"a micro-batch in flight, and torch's schedules hang or fail otherwise. Use pp_microbatches >= "
                f"{self.pp_size}.")
        points = self.pp_split_points
        if isinstance(points, str):
            points = [name.strip() for name in points.split(",") if name.strip()]
        self.pp_split_points = list(points) if points is not None else None

    def __repr__(self) -> str:
        sizes = ", ".join(f"{name}={getattr(self, name)}" for name in _SIZE_FIELDS[:4])
        pipeline = (f", pp_size={self.pp_size}, pp_schedule={self.pp_schedule!r}, "
                    f"pp_microbatches={self.pipeline_microbatches}") if self.pp_enabled else ""
        return f"ParallelismConfig({sizes}{pipeline})"

    def to_json(self) -> str:
        """The sizes, backends and handlers (as dicts) as JSON; the mesh is left out."""
        data = {key: (dataclasses.asdict(value) if dataclasses.is_dataclass(value) and not isinstance(value, type) else value)
                for key, value in vars(self).items() if key not in ("device_mesh", "_unset")}
        return json.dumps(data, default=repr)

    # --------------------------------------------------------------------------------- sizes
    @property
    def total_size(self) -> int:
        """Processes the configuration needs: the product of every size."""
        return (self.dp_replicate_size * self.dp_shard_size * self.tp_size * self.cp_size  # type: ignore[operator]
                * self.sp_size * self.pp_size)

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different batches: ``dp_replicate_size * dp_shard_size``."""
        return self.dp_replicate_size * self.dp_shard_size  # type: ignore[operator]

    @property
    def non_data_parallel_size(self) -> int:
        """Ranks that share one batch: ``tp_size * cp_size * pp_size``."""
        return self.tp_size * self.cp_size * self.pp_size  # type: ignore[operator]

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate_size > 1  # type: ignore[operator]

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard_size > 1  # type: ignore[operator]

    @property
    def tp_enabled(self) -> bool:
        return self.tp_size > 1  # type: ignore[operator]

    @property
    def cp_enabled(self) -> bool:
        return self.cp_size > 1  # type: ignore[operator]

    @property
    def pipeline_microbatches(self) -> int:
        """Micro-batches per batch under pipeline parallelism: ``pp_microbatches``, else ``pp_size``."""
        return int(self.pp_microbatches if self.pp_microbatches is not None else self.pp_size)  # type: ignore[arg-type]

    @property
    def pipeline_stages_per_process(self) -> int:
        """Pipeline stages each process holds: from the split points when given, else 2 for the schedules that
        run several stages per process and 1 for GPipe and 1F1B."""
        if self.pp_split_points is not None:
            return max(1, (len(self.pp_split_points) + 1) // int(self.pp_size))  # type: ignore[arg-type]
        return 2 if self.pp_schedule in PP_MULTI_STAGE else 1

    @property
    def pp_enabled(self) -> bool:
        """The model is cut into pipeline stages (``pp_size > 1``)."""
        return self.pp_size > 1  # type: ignore[operator]

    @property
    def sp_enabled(self) -> bool:
        return self.sp_size > 1  # type: ignore[operator]

    @property
    def fsdp_enabled(self) -> bool:
        """Parameters are sharded (FSDP2/HSDP): a shard or context dimension exists."""
        return self.dp_shard_enabled or self.cp_enabled

    @property
    def active_mesh_dims(self) -> list[str]:
        """The mesh dimensions of size > 1, outermost first."""
        return [name for name in MESH_ORDER if getattr(self, f"{name}_size") > 1]

    @property
    def mesh_dim_names(self) -> list[str]:
        """The mesh's dimensions: the active ones plus ``dp_shard`` (size 1 when not sharding), outermost first.

        ``dp_shard`` is always there so ``fully_shard`` has a data-parallel dimension to work on even for
        tensor-parallel-only or DDP + TP runs.
        """
        return [name for name in MESH_ORDER if getattr(self, f"{name}_size") > 1 or name == "dp_shard"]

    @property
    def dp_dim_names(self) -> list[str]:
        return [n for n in ("dp_replicate", "dp_shard") if n in self.mesh_dim_names]

    @property
    def non_dp_dim_names(self) -> list[str]:
        """Dimensions whose ranks share one batch (Accelerate's order)."""
        return [n for n in ("tp", "cp") if n in self.mesh_dim_names]

    @property
    def dp_shard_cp_dim_names(self) -> list[str]:
        return [n for n in ("dp_shard", "cp") if n in self.mesh_dim_names]

    @property
    def dp_cp_dim_names(self) -> list[str]:
        return [n for n in ("dp_replicate", "dp_shard", "cp") if n in self.mesh_dim_names]

    @property
    def fsdp_dim_names(self) -> list[str]:
        """What ``fully_shard`` gets: ``dp_replicate`` (HSDP) and the flattened ``dp_shard_cp``."""
        return (["dp_replicate"] if self.dp_replicate_enabled else []) + ["dp_shard_cp"]

    def mesh_shape(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """``(names, sizes)`` of the mesh, outermost first."""
        names = tuple(self.mesh_dim_names)
        return names, tuple(getattr(self, f"{name}_size") for name in names)

    def describe(self) -> str:
        """One line for logs and ``hasten launch --dry_run``: the mesh and what each dimension does."""
        names, sizes = self.mesh_shape()
        shape = " x ".join(f"{n}={s}" for n, s in zip(names, sizes))
        return f"DeviceMesh({shape}) over {self.total_size} processes; data-parallel size {self.data_parallel_size}"

    # ------------------------------------------------------------------------------ validation
    def validate(self, num_processes: int, *, device_type: str | None = "cpu") -> None:
        """Refuse sizes this run cannot use, before any process group starts.

        ``device_type=None`` (``hasten launch``, which does not know the workers' device) checks the sizes only.

        Raises:
            ConfigurationError: the sizes' product differs from ``num_processes``, or a combination
                PyTorch cannot run here (context parallel off CUDA, async TP off CUDA).
        """
        if self.total_size != num_processes:
            shown = (*_SIZE_FIELDS[:4], "pp_size") if self.pp_enabled else _SIZE_FIELDS[:4]
            product = " x ".join(f"{name}={getattr(self, name)}" for name in shown)
            raise ConfigurationError(  # Accelerate's wording first (its tests match it), then hasten's detail
                f"ParallelismConfig total_size ({self.total_size}) does not match num_processes ({num_processes}). "
                f"It needs {product} = {self.total_size} processes, but the run has {num_processes}. "
                "Make the product of dp_replicate_size, dp_shard_size, tp_size, cp_size and pp_size equal the number "
                "of processes (`hasten launch --num_processes`).")
        if self.pp_enabled and self.cp_enabled:
            raise ConfigurationError(
                f"pp_size={self.pp_size} with {self}: pipeline parallelism composes with replication, sharding and "
                "tensor parallelism (dp_replicate_size, dp_shard_size, tp_size) so far, not with context "
                "parallelism; set cp_size to 1.")
        if device_type is None:
            return
        if self.cp_enabled and device_type != "cuda":
            raise ConfigurationError(
                f"cp_size={self.cp_size} needs CUDA: PyTorch's context parallel "
                "(torch.distributed.tensor.experimental.context_parallel) rings attention through "
                "scaled_dot_product_attention's flash/efficient/cuDNN kernels only; on the CPU, attention runs "
                "aten._scaled_dot_product_flash_attention_for_cpu, which has no sharding strategy registered "
                f"(NotImplementedError in torch {_torch_version()}). Use cp_size=1 on {device_type}.")
        if self.tp_handler is not None and self.tp_handler.enable_async_tp and device_type != "cuda":
            raise ConfigurationError("enable_async_tp needs CUDA (symmetric-memory collectives); turn it off on "
                                     f"{device_type}.")

    # ------------------------------------------------------------------------------------ mesh
    def build_device_mesh(self, device_type: str) -> Any:
        """A new ``DeviceMesh`` of these sizes (needs the process group), with the flattened data-parallel views.

        hasten's one mesh builder: an ``Accelerator`` calls it once per run and hands the mesh to the
        strategy and to ``accelerator.parallelism_config`` (this config itself is left unchanged).
        """
        from torch.distributed.device_mesh import init_device_mesh

        names, sizes = self.mesh_shape()
        mesh = init_device_mesh(device_type, sizes, mesh_dim_names=names)
        # Accelerate's flattened views, always present (a view of one dimension is that dimension).
        for flat, parts in (("dp", self.dp_dim_names), ("dp_shard_cp", self.dp_shard_cp_dim_names),
                            ("dp_cp", self.dp_cp_dim_names)):
            flatten_mesh(mesh[tuple(parts)], flat)
        return mesh

    def _get_mesh(self) -> tuple[tuple[Any, ...], ...]:
        """Accelerate's helper: ``(names, sizes)`` of the dimensions larger than 1, outermost first (``()``
        when every size is 1). hasten's own mesh (:meth:`mesh_shape`) also keeps a ``dp_shard`` of 1."""
        return tuple(zip(*[(name, getattr(self, f"{name}_size")) for name in self.active_mesh_dims]))

    def _set_size(self, parallelism: str, size: int) -> None:
        """Accelerate's helper: set ``<parallelism>_size`` (``"dp_replicate"``, ``"dp_shard"``, ``"tp"``, ``"cp"``).

        Raises:
            ConfigurationError: an unknown dimension, or a size below 1.
        """
        if f"{parallelism}_size" not in _SIZE_FIELDS:
            raise ConfigurationError(f"Parallelism must be one of {[f[:-5] for f in _SIZE_FIELDS]}, got {parallelism!r}.")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigurationError(f"ParallelismConfig {parallelism}_size={size!r} must be a positive integer.")
        setattr(self, f"{parallelism}_size", size)
        self._unset = self._unset - {f"{parallelism}_size"}

    def _validate_accelerator(self, accelerator: Any) -> None:
        """Accelerate's check against a run: sizes of 1 on several processes become data parallel
        (``dp_replicate_size`` = processes), then the product must equal the number of processes.

        Raises:
            ConfigurationError: as :meth:`validate`, on the accelerator's device.
        """
        if not accelerator.multi_device and self.total_size == 1:
            return
        if self.total_size == 1:
            self._set_size("dp_replicate", accelerator.num_processes)
        self.validate(accelerator.num_processes, device_type=accelerator.device.type)

    def get_device_mesh(self, device_type: str | None = None) -> Any:
        """The run's mesh (on ``accelerator.parallelism_config``); on a config without one, ``device_type``
        builds a new mesh, which is returned and not kept (the config never changes).

        Raises:
            ConfigurationError: no mesh and no ``device_type``, or a ``device_type`` other than the mesh's.
        """
        if self.device_mesh is not None:
            if device_type is not None and device_type != self.device_mesh.device_type:
                raise ConfigurationError(f"The run's mesh is on {self.device_mesh.device_type!r}, not {device_type!r}.")
            return self.device_mesh
        if device_type is None:
            raise ConfigurationError("This ParallelismConfig has no mesh: use the run's (accelerator.torch_device_mesh "
                                     "or accelerator.parallelism_config.get_device_mesh()), or pass device_type.")
        return self.build_device_mesh(device_type)


def parallelism_config_from_launch(launch: Mapping[str, Any]) -> ParallelismConfig | None:
    """The ``parallelism_config`` block of the launch configuration (``--parallelism_config_*``), or None."""
    sizes = _block_fields(launch)
    return ParallelismConfig(**sizes) if sizes else None


@overload
def resolve_parallelism_config(config: ParallelismConfig, *, launch_block: Mapping[str, Any] | None = None,
                               env: Mapping[str, str] | None = None, num_processes: int = 1) -> ParallelismConfig: ...


@overload
def resolve_parallelism_config(config: None, *, launch_block: Mapping[str, Any] | None = None,
                               env: Mapping[str, str] | None = None, num_processes: int = 1) -> None: ...


def resolve_parallelism_config(config: ParallelismConfig | None, *, launch_block: Mapping[str, Any] | None = None,
                               env: Mapping[str, str] | None = None,
                               num_processes: int = 1) -> ParallelismConfig | None:
    """The run's ``ParallelismConfig``: ``config`` plus what the launch says; ``config`` itself never changes.

    The fields ``config`` left ``None`` (``ParallelismConfig._unset``) are taken from the launch
    configuration's ``parallelism_config`` block (``hasten launch --parallelism_config_*``), over
    Accelerate's ``PARALLELISM_CONFIG_*`` variables (``accelerate launch``; read from ``env``, the
    process environment when None), as Accelerate's ``ParallelismConfig()`` reads them. Then, as in
    Accelerate, every size 1 on several processes is DDP over all of them (``dp_replicate_size``).

    Returns:
        ``config`` itself when nothing changes (and None for None), else a new config
        (``dataclasses.replace``).

    Example:
        >>> resolve_parallelism_config(ParallelismConfig(), env={"PARALLELISM_CONFIG_DP_SHARD_SIZE": "2"},
        ...                            num_processes=2).dp_shard_size
        2
    """
    if config is None:
        return None
    from hasten.config.env import accelerate_parallelism_env

    launched = _block_fields({"parallelism_config": accelerate_parallelism_env(env)})
    launched.update(_block_fields({"parallelism_config": launch_block or {}}))
    changes = {name: value for name, value in launched.items() if name in config._unset}
    resolved = dataclasses.replace(config, **changes) if changes else config
    if resolved.total_size == 1 and num_processes > 1:
        resolved = dataclasses.replace(resolved, dp_replicate_size=num_processes)
    return resolved


def _block_fields(launch: Mapping[str, Any]) -> dict[str, Any]:
    block = launch.get("parallelism_config") or {}
    sizes: dict[str, Any] = {}
    for key, value in block.items():
        name = key.removeprefix("parallelism_config_")
        if value is None or str(value) == "-1":  # Accelerate's "not set"
            continue
        if name in _SIZE_FIELDS or name in ("pp_schedule", "pp_microbatches", "pp_split_points"):
            sizes[name] = value
        elif name == "tp_enable_async_tp" or name == "enable_async_tp":
            sizes["tp_handler"] = TorchTensorParallelConfig(enable_async_tp=str(value).lower() in ("1", "true"))
        elif name == "cp_comm_strategy":
            sizes["cp_handler"] = TorchContextParallelConfig(cp_comm_strategy=str(value))
        elif name in ("cp_backend", "sp_backend"):
            sizes[name] = str(value)
        elif name.startswith("sp_"):
            raise ConfigurationError(f"parallelism_config {key}={value!r}: DeepSpeed-Ulysses sequence parallelism is "
                                     "not available in hasten.")
        else:
            raise ConfigurationError(f"Unknown parallelism_config key {key!r}: expected parallelism_config_"
                                     f"{{{', '.join(_SIZE_FIELDS)}, cp_backend, sp_backend, cp_comm_strategy, pp_schedule, "
                                     "pp_microbatches, pp_split_points}.")
    return sizes


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def _is_parallel_style(style: Any) -> bool:
    from torch.distributed.tensor.parallel import ParallelStyle

    return isinstance(style, ParallelStyle)


__all__ = ["MESH_ORDER", "PP_MULTI_STAGE", "PP_SCHEDULES", "ParallelismConfig", "TorchContextParallelConfig",
           "TorchTensorParallelConfig", "parallelism_config_from_launch", "resolve_parallelism_config"]
