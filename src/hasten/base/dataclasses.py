"""Accelerate-compatible enums and keyword-argument handlers (pure data: nothing here reads the environment)."""

from __future__ import annotations

import copy
import enum
import warnings
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any, Literal

from hasten._lazy import accelerate_path_getattr


class EnumWithContains(enum.EnumMeta):
    """Enum metaclass whose ``in`` accepts values: ``"fp16" in PrecisionType``."""

    def __contains__(cls, item: object) -> bool:
        try:
            cls(item)
        except ValueError:
            return False
        return True


class BaseEnum(enum.Enum, metaclass=EnumWithContains):
    """An enum whose ``str()`` is its value, with ``list()`` of every value as a string."""

    def __str__(self) -> str:
        return str(self.value)

    @classmethod
    def list(cls) -> list[str]:
        return [str(m) for m in cls]


class _StrEnum(str, enum.Enum):
    def __str__(self) -> str:
        return str(self.value)

    @classmethod
    def list(cls) -> list[str]:
        return [m.value for m in cls]


class _RenamedMembers(enum.EnumMeta):
    """Enum metaclass that answers a renamed member's old name with the new member and a ``FutureWarning``.

    The old name is not a member of its own (``list(DistributedType)`` and ``__members__`` stay Accelerate's),
    so a normal lookup misses it and lands here; existing members are class attributes and never pay for this.
    """

    #: enum class name -> {old member name: current member name}
    renamed: dict[str, dict[str, str]] = {"DistributedType": {"TPU": "XLA"}}

    def _current_name(cls, name: str) -> str | None:
        current = _RenamedMembers.renamed.get(cls.__name__, {}).get(name)
        if current is not None:
            warnings.warn(f"{cls.__name__}.{name} is deprecated (renamed {cls.__name__}.{current} in Accelerate 1.0) "
                          f"and will be removed; use {cls.__name__}.{current}.", FutureWarning, stacklevel=3)
        return current

    def __getattr__(cls, name: str) -> Any:
        current = None if name.startswith("_") else cls._current_name(name)
        if current is not None:
            return cls[current]
        fallback = getattr(enum.EnumMeta, "__getattr__", None)  # Python < 3.12 looks members up here
        if fallback is None:
            raise AttributeError(name)
        return fallback(cls, name)

    def __getitem__(cls, name: str) -> Any:
        return super().__getitem__(cls._current_name(name) or name)


class DistributedType(_StrEnum, metaclass=_RenamedMembers):
    """How the current run is distributed (compatibility/reporting value; hasten's parts decide behaviour).

    ``DistributedType.TPU`` (Accelerate before 1.0, still used by transformers' ``run_*_no_trainer.py``
    examples) is ``DistributedType.XLA``, with a ``FutureWarning``.
    """

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"


class ComputeEnvironment(_StrEnum):
    """Where the run happens."""

    LOCAL_MACHINE = "LOCAL_MACHINE"
    AMAZON_SAGEMAKER = "AMAZON_SAGEMAKER"


class PrecisionType(_StrEnum):
    """Mixed precision modes."""

    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"


class RNGType(_StrEnum):
    """Random number generators that can be synchronised across processes."""

    TORCH = "torch"
    CUDA = "cuda"
    XLA = "xla"
    NPU = "npu"
    MLU = "mlu"
    SDAA = "sdaa"
    MUSA = "musa"
    XPU = "xpu"
    HPU = "hpu"
    NEURON = "neuron"
    GENERATOR = "generator"


class LoggerType(_StrEnum):
    """Built-in experiment trackers."""

    ALL = "all"
    JSONL = "jsonl"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    MLFLOW = "mlflow"
    COMETML = "comet_ml"
    AIM = "aim"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"
    TRACKIO = "trackio"


class DynamoBackend(_StrEnum):
    """torch.compile backends."""

    NO = "NO"
    EAGER = "EAGER"
    AOT_EAGER = "AOT_EAGER"
    INDUCTOR = "INDUCTOR"
    AOT_TS_NVFUSER = "AOT_TS_NVFUSER"
    NVPRIMS_NVFUSER = "NVPRIMS_NVFUSER"
    CUDAGRAPHS = "CUDAGRAPHS"
    OFI = "OFI"
    FX2TRT = "FX2TRT"
    ONNXRT = "ONNXRT"
    TENSORRT = "TENSORRT"
    AOT_TORCHXLA_TRACE_ONCE = "AOT_TORCHXLA_TRACE_ONCE"
    TORCHXLA_TRACE_ONCE = "TORCHXLA_TRACE_ONCE"
    IPEX = "IPEX"
    TVM = "TVM"
    HPU_BACKEND = "HPU_BACKEND"
    NEURON = "NEURON"


class DDPCommunicationHookType(_StrEnum):
    """Built-in DDP communication hooks."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


class KwargsHandler:
    """Base of the ``*Kwargs`` dataclasses: ``to_kwargs()`` returns only the fields changed from their defaults."""

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.__dict__)

    def to_kwargs(self) -> dict[str, Any]:
        default = self.__class__()
        this = self.to_dict()
        base = default.to_dict()
        return {k: v for k, v in this.items() if base.get(k) != v}


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """Arguments for ``torch.distributed.init_process_group``.

    hasten always passes a timeout (30 minutes unless given), so no collective waits forever.

    Example:
        >>> InitProcessGroupKwargs(timeout=timedelta(seconds=120))
    """

    backend: str | None = "nccl"
    init_method: str | None = None
    timeout: timedelta | None = None

    def __post_init__(self) -> None:
        if self.timeout is not None and not isinstance(self.timeout, timedelta):
            raise TypeError(f"InitProcessGroupKwargs.timeout must be a datetime.timedelta, got {self.timeout!r}")


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Arguments forwarded to ``torch.nn.parallel.DistributedDataParallel``.

    Example:
        >>> DistributedDataParallelKwargs(find_unused_parameters=True)
    """

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: Literal["no", "fp16", "bf16"] | DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_state_option: dict[str, Any] = field(default_factory=dict)

    def to_dict(self, ignore_keys: tuple[str, ...] = ("comm_hook", "comm_wrapper", "comm_state_option")) -> dict[str, Any]:
        return {k: v for k, v in super().to_dict().items() if k not in ignore_keys}

    def register_comm_hook(self, model: Any) -> None:
        """Install this handler's ``comm_hook`` (optionally wrapped by ``comm_wrapper``) on a DDP model."""
        from hasten.base.ddp_hooks import install_comm_hook

        install_comm_hook(model, DDPCommunicationHookType(self.comm_hook).value,
                          DDPCommunicationHookType(self.comm_wrapper).value, self.comm_state_option)


@dataclass
class GradScalerKwargs(KwargsHandler):
    """Arguments for ``torch.amp.GradScaler`` (fp16 loss scaling).

    Example:
        >>> GradScalerKwargs(init_scale=1024.0)
    """

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclass
class AutocastKwargs(KwargsHandler):
    """Arguments for ``torch.autocast`` (``enabled``, ``cache_enabled``).

    Example:
        >>> AutocastKwargs(enabled=False)
    """

    enabled: bool = True
    cache_enabled: bool | None = None


@dataclass
class GradientAccumulationPlugin(KwargsHandler):
    """How gradients are accumulated.

    Args:
        num_steps: micro-batches per optimizer step.
        adjust_scheduler: step the scheduler once per accumulation window.
        sync_with_dataloader: always sync on the last batch of a prepared data loader.
        sync_each_batch: all-reduce on every batch (saves memory, costs communication).

    Example:
        >>> GradientAccumulationPlugin(num_steps=4)
    """

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False

    def __post_init__(self) -> None:
        if self.num_steps is not None and (not isinstance(self.num_steps, int) or self.num_steps < 1):
            raise ValueError(f"GradientAccumulationPlugin(num_steps={self.num_steps!r}): use a positive integer")


@dataclass
class DataLoaderConfiguration:
    """How prepared data loaders shard and iterate.

    Example:
        >>> DataLoaderConfiguration(even_batches=False)
    """

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False


@dataclass
class ProjectConfiguration:
    """Where the project writes checkpoints and logs, and how checkpoints are named.

    Example:
        >>> ProjectConfiguration(project_dir="runs/a", automatic_checkpoint_naming=True, total_limit=3)
    """

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def set_directories(self, project_dir: str | None = None) -> None:
        """Set ``project_dir`` and default ``logging_dir`` to it."""
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir

    def __post_init__(self) -> None:
        self.set_directories(self.project_dir)


def dataclass_field_names(obj: Any) -> list[str]:
    """Names of a dataclass's fields (helper for config round trips)."""
    return [f.name for f in fields(obj)]


@dataclass
class TorchDynamoPlugin(KwargsHandler):
    """``torch.compile`` settings for prepared models.

    Example:
        >>> TorchDynamoPlugin(backend="inductor", mode="reduce-overhead")
    """

    backend: DynamoBackend | str | None = None
    mode: str | None = None
    fullgraph: bool | None = None
    dynamic: bool | None = None
    options: Any = None
    disable: bool = False
    use_regional_compilation: bool | None = None

    def __post_init__(self) -> None:
        # Settings left None come from Accelerate's ACCELERATE_DYNAMO_* variables when they are set.
        from hasten.base.environment import accelerate_dynamo_env

        env = accelerate_dynamo_env()
        for name, value in env.items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.backend is None:
            self.backend = DynamoBackend.NO
        name = str(getattr(self.backend, "value", self.backend)).upper()
        if name not in DynamoBackend.list():
            raise ValueError(f"TorchDynamoPlugin(backend={self.backend!r}): choose one of {DynamoBackend.list()}")
        self.backend = DynamoBackend(name)


@dataclass
class TorchTensorParallelPlugin:
    """Accelerate's older tensor-parallel switch (deprecated there too): ``Accelerator(torch_tp_plugin=
    TorchTensorParallelPlugin(tp_size=n))`` runs as ``parallelism_config=ParallelismConfig(tp_size=n)``,
    hasten's N-D tensor-parallel path.

    Example:
        >>> Accelerator(torch_tp_plugin=TorchTensorParallelPlugin(tp_size=2))  # FutureWarning, as Accelerate's
    """

    tp_size: int = 1
    torch_device_mesh: Any = None


PROFILE_PATTERN_NAME = "profile_{suffix}.json"


@dataclass
class ProfileKwargs(KwargsHandler):
    """``torch.profiler.profile`` settings for ``accelerator.profile()``.

    Args:
        activities: "cpu", "cuda", "xpu" (default: what is available).
        schedule_option: keyword arguments of ``torch.profiler.schedule`` (wait, warmup, active, repeat, skip_first).
        on_trace_ready: callable run when a trace is ready.
        output_trace_dir: write a Chrome trace ``profile_{rank}.json`` per process there.

    Example:
        >>> ProfileKwargs(activities=["cpu"], record_shapes=True, output_trace_dir="traces")
    """

    activities: list[str] | None = None
    schedule_option: dict[str, int] | None = None
    on_trace_ready: Any = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None

    def build(self) -> Any:
        """The ``torch.profiler.profile`` object these settings describe."""
        import torch

        names = {"cpu": torch.profiler.ProfilerActivity.CPU, "cuda": torch.profiler.ProfilerActivity.CUDA}
        if hasattr(torch.profiler.ProfilerActivity, "XPU"):
            names["xpu"] = torch.profiler.ProfilerActivity.XPU
        activities = None
        if self.activities is not None:
            unknown = [a for a in self.activities if a not in names]
            if unknown:
                raise ValueError(f"ProfileKwargs(activities={self.activities!r}): unknown {unknown}; use {sorted(names)}")
            activities = [names[a] for a in self.activities]
        schedule = torch.profiler.schedule(**self.schedule_option) if self.schedule_option else None
        return torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=self.on_trace_ready,
                                      record_shapes=self.record_shapes, profile_memory=self.profile_memory,
                                      with_stack=self.with_stack, with_flops=self.with_flops,
                                      with_modules=self.with_modules)


# Names Accelerate shows at this module path but hasten defines elsewhere (hasten/_accelerate_paths.py).
__getattr__ = accelerate_path_getattr(__name__, globals())
