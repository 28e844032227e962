"""Turn the user's arguments, the launch configuration and the environment into settings and parts.

``resolve_settings`` is pure (no process group, no global state): the Accelerator calls it with its
keyword arguments, the ``HASTEN_LAUNCH_CONFIG`` dict and nothing else, so every precedence rule and
conflict is testable with plain tables. Precedence: explicit arguments and plugin objects > launch
configuration > defaults. When an explicit argument contradicts an explicit launch setting, hasten
raises instead of guessing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hasten.base.dataclasses import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    DistributedType,
    DynamoBackend,
    GradScalerKwargs,
)
from hasten.base.fp8 import AORecipeKwargs
from hasten.config.schema import LaunchConfig
from hasten.exceptions import ConfigurationError
from hasten.precision import SUPPORTED, Precision, create_precision
from hasten.strategies import DDPStrategy, SingleDeviceStrategy, Strategy


@dataclass(frozen=True)
class Settings:
    """What the Accelerator will do, after merging every source."""

    mixed_precision: str
    gradient_accumulation_steps: int
    dynamo_backend: str
    dynamo_kwargs: tuple[tuple[str, Any], ...]
    cpu: bool
    fsdp_plugin: Any = None
    deepspeed_plugin: Any = None
    parallelism_config: Any = None


def _precision(explicit: Any, launch: LaunchConfig) -> str:
    launched = launch.mixed_precision  # validated by the schema: one of MIXED_PRECISIONS, "no" when not set
    if explicit is not None:
        value = str(getattr(explicit, "value", explicit)).lower()
        if launched not in (None, "no") and launched != value:
            raise ConfigurationError(
                f"Accelerator(mixed_precision={value!r}) conflicts with the launch configuration's "
                f"mixed_precision={launched!r} (from `hasten launch --mixed_precision` or the config file). "
                "Set it in one place only.")
    else:
        value = launched or "no"
    if value not in SUPPORTED and value != "fp8":
        raise ConfigurationError(f"Unknown mixed_precision {value!r}: choose one of {SUPPORTED}.")
    return value


def _fp8_hardware(cpu: bool) -> tuple[bool, tuple[int, int] | None, str]:
    """(runs on the CPU, compute capability, device name) of the device this process would use."""
    from hasten.devices import select_device

    device = select_device(cpu=cpu)
    return device.name == "cpu", device.compute_capability(), device.device_label()


def _check_fp8(handlers: Mapping[type, Any], launch: LaunchConfig, cpu: bool) -> str:
    """The fp8 engine for this run, after refusing clearly where it cannot run (names the requirement)."""
    from hasten.base.imports import is_msamp_available, is_torchao_available, is_transformer_engine_available
    from hasten.precision.fp8 import check_fp8_support, fp8_backend

    backend = fp8_backend(handlers, launch.fp8_config)
    on_cpu, capability, label = _fp8_hardware(cpu)
    package = {"TE": is_transformer_engine_available, "MSAMP": is_msamp_available}.get(backend)
    check_fp8_support(backend, on_cpu=on_cpu, capability=capability, device_label=label,
                      torchao_available=is_torchao_available(),
                      backend_package_available=bool(package and package()))
    return backend


def _launched_accumulation(launch: LaunchConfig) -> int | None:
    """Accumulation steps set at launch: Accelerate's launcher takes them from the ``deepspeed_config`` block."""
    if launch.distributed_type != "DEEPSPEED":
        return None
    steps = launch.deepspeed_config.get("gradient_accumulation_steps")
    if steps is None or isinstance(steps, bool) or not str(steps).strip().isdigit():
        if steps is not None and str(steps).lower() != "auto":
            raise ConfigurationError(f"deepspeed_config.gradient_accumulation_steps={steps!r} in the launch "
                                     "configuration must be a positive integer (or 'auto').")
        return None
    return int(str(steps).strip())


def _accumulation(steps: Any, plugin: Any, launch: LaunchConfig) -> int:
    if plugin is not None and steps != 1:
        raise ConfigurationError(
            f"Both gradient_accumulation_steps={steps!r} and gradient_accumulation_plugin={plugin!r} were given; "
            "pass only one (the plugin's num_steps, or the integer).")
    launched = _launched_accumulation(launch)
    if plugin is not None:
        value = plugin.num_steps if plugin.num_steps is not None else (launched or 1)
    elif steps == 1 and launched is not None:
        value = launched
    else:
        value = steps
    if isinstance(value, bool) or not isinstance(value, int) and not str(value).isdigit():
        raise ConfigurationError(f"gradient_accumulation_steps={value!r} must be a positive integer.")
    value = int(value)
    if value < 1:
        raise ConfigurationError(f"gradient_accumulation_steps={value} must be at least 1.")
    return value


def _dynamo(backend: Any, plugin: Any, launch: LaunchConfig) -> tuple[str, tuple[tuple[str, Any], ...]]:
    if backend is not None and plugin is not None:
        raise ConfigurationError(f"Both dynamo_backend={backend!r} and dynamo_plugin={plugin!r} were given; "
                                 "pass only one.")
    kwargs: dict[str, Any] = {}
    if plugin is not None:
        name = "no" if getattr(plugin, "disable", False) else str(getattr(plugin, "backend", "no"))
        for key in ("mode", "fullgraph", "dynamic"):
            if getattr(plugin, key, None) is not None:
                kwargs[key] = getattr(plugin, key)
    elif backend is not None:
        name = str(getattr(backend, "value", backend))
    else:
        config = launch.dynamo_config
        name = str(config.get("dynamo_backend", "no"))
        for key in ("mode", "fullgraph", "dynamic"):
            if config.get(f"dynamo_{key if key != 'fullgraph' else 'use_fullgraph'}") is not None:
                kwargs[key] = config[f"dynamo_{key if key != 'fullgraph' else 'use_fullgraph'}"]
    upper = name.upper()
    if upper not in DynamoBackend.list():
        raise ConfigurationError(f"Unknown dynamo_backend {name!r}: choose one of {DynamoBackend.list()}.")
    return upper, tuple(sorted(kwargs.items()))


def as_launch_config(launch: LaunchConfig | Mapping[str, Any] | None) -> LaunchConfig:
    """The typed launch configuration: a mapping (``to_launch_dict`` form) is parsed and validated."""
    if launch is None:
        return LaunchConfig()
    if isinstance(launch, LaunchConfig):
        return launch
    return LaunchConfig.from_launch_dict(launch, source="the launch configuration")


def resolve_settings(kwargs: Mapping[str, Any], launch: LaunchConfig | Mapping[str, Any] | None) -> Settings:
    """Merge ``Accelerator(...)`` arguments with the launch configuration.

    ``launch`` is the typed :class:`LaunchConfig` the worker received (``None`` when not launched by
    ``hasten launch``); a plain mapping is parsed with :meth:`LaunchConfig.from_launch_dict`.

    Example:
        >>> resolve_settings({"mixed_precision": "bf16"}, {}).mixed_precision
        'bf16'

    Raises:
        ConfigurationError: invalid values, or an argument that contradicts the launch configuration.
    """
    launch = as_launch_config(launch)
    dynamo_backend, dynamo_kwargs = _dynamo(kwargs.get("dynamo_backend"), kwargs.get("dynamo_plugin"), launch)
    cpu = bool(kwargs.get("cpu")) or launch.use_cpu
    mixed_precision = _precision(kwargs.get("mixed_precision"), launch)
    if mixed_precision == "fp8":
        _check_fp8(kwargs.get("kwargs_handlers") or {}, launch, cpu)
    return Settings(
        mixed_precision=mixed_precision,
        gradient_accumulation_steps=_accumulation(kwargs.get("gradient_accumulation_steps", 1),
                                                  kwargs.get("gradient_accumulation_plugin"), launch),
        dynamo_backend=dynamo_backend,
        dynamo_kwargs=dynamo_kwargs,
        cpu=cpu,
        fsdp_plugin=_fsdp_plugin(kwargs.get("fsdp_plugin"), launch),
        deepspeed_plugin=_deepspeed_plugin(kwargs.get("deepspeed_plugin"), launch),
        parallelism_config=_parallelism_config(kwargs.get("parallelism_config"), launch),
    )


def _parallelism_config(explicit: Any, launch: LaunchConfig) -> Any:
    from hasten.config.parallelism import ParallelismConfig, parallelism_config_from_launch

    if explicit is not None:
        if not isinstance(explicit, ParallelismConfig):
            raise ConfigurationError(f"parallelism_config must be a hasten ParallelismConfig, got "
                                     f"{type(explicit).__module__}.{type(explicit).__name__}; build it with "
                                     "`from hasten import ParallelismConfig`.")
        return explicit
    config = parallelism_config_from_launch({"parallelism_config": launch.parallelism_config})
    if config is None and launch.use_parallelism_config:
        # `--use_parallelism_config` with no sizes: Accelerate builds a default config (plain data parallel).
        config = ParallelismConfig()
    return config


def uses_nd_strategy(config: Any) -> bool:
    """True when ``config`` needs the N-D strategy (anything beyond plain replication)."""
    return config is not None and (config.dp_shard_enabled or config.tp_enabled or config.cp_enabled)


def _fsdp_plugin(explicit: Any, launch: LaunchConfig) -> Any:
    if explicit is not None:
        return explicit
    if launch.distributed_type != "FSDP" and not launch.fsdp_config:
        return None
    from hasten.config.plugins.fsdp import fsdp_plugin_from_launch_config  # only when FSDP is asked for

    return fsdp_plugin_from_launch_config(launch)


def _deepspeed_plugin(explicit: Any, launch: LaunchConfig) -> Any:
    if isinstance(explicit, dict):  # several named plugins: the first is active
        explicit = next(iter(explicit.values()), None)
    if explicit is not None:
        return explicit
    if launch.distributed_type != "DEEPSPEED":
        return None
    from hasten.config.plugins.deepspeed import deepspeed_plugin_from_launch_config

    return deepspeed_plugin_from_launch_config(launch)


def build_parts(settings: Settings, device: torch.device, distributed_type: DistributedType, num_processes: int,
                handlers: Mapping[type, Any]) -> tuple[Precision, Strategy]:
    """Create the strategy for this process and the precision plugin its engine needs.

    The strategy is chosen first (DeepSpeed, FSDP2, DDP, single device), then its precision class:
    DeepSpeed's writes the engine's fp16/bf16 blocks, FSDP2's adds the ``MixedPrecisionPolicy``,
    the others use torch autocast (and a GradScaler for fp16).
    """
    if settings.fsdp_plugin is not None and settings.deepspeed_plugin is not None:
        raise ConfigurationError("Both an FSDP plugin and a DeepSpeed plugin were given (arguments or launch "
                                 "configuration); choose one.")
    config = settings.parallelism_config
    if config is not None and settings.deepspeed_plugin is not None and config.total_size > 1:
        raise ConfigurationError(f"{config!r} and a DeepSpeed plugin were both given: DeepSpeed partitions the "
                                 "model itself; use one of them.")
    if settings.deepspeed_plugin is not None:
        from hasten.precision.deepspeed import DeepSpeedPrecision
        from hasten.strategies.deepspeed import DeepSpeedStrategy  # imports deepspeed lazily

        strategy: Strategy = DeepSpeedStrategy(device, DeepSpeedPrecision(settings.mixed_precision, device.type),
                                               DistributedType.DEEPSPEED, num_processes,
                                               plugin=settings.deepspeed_plugin,
                                               gradient_accumulation_steps=settings.gradient_accumulation_steps)
        return strategy.precision, strategy
    precision = create_precision(settings.mixed_precision, device.type,
                                 autocast_handler=handlers.get(AutocastKwargs),
                                 scaler_handler=handlers.get(GradScalerKwargs),
                                 fp8_recipe=handlers.get(AORecipeKwargs))
    if config is not None and config.pp_enabled:
        from hasten.strategies.pipeline import PipelineStrategy

        strategy = PipelineStrategy(device, precision, distributed_type, num_processes, config=config)
    elif uses_nd_strategy(config):
        from hasten.precision.fsdp import FSDPPrecision
        from hasten.strategies.nd import NDParallelStrategy

        plugin = settings.fsdp_plugin
        precision = FSDPPrecision(precision, getattr(plugin, "mixed_precision_policy", None))
        strategy = NDParallelStrategy(device, precision, DistributedType.FSDP, num_processes, config=config,
                                      plugin=plugin)
    elif settings.fsdp_plugin is not None:
        from hasten.precision.fsdp import FSDPPrecision
        from hasten.strategies.fsdp2 import FSDP2Strategy

        precision = FSDPPrecision(precision, getattr(settings.fsdp_plugin, "mixed_precision_policy", None))
        strategy = FSDP2Strategy(device, precision, DistributedType.FSDP, num_processes, plugin=settings.fsdp_plugin,
                                 world_mesh=getattr(config, "device_mesh", None))
    elif num_processes > 1:
        strategy = DDPStrategy(device, precision, distributed_type, num_processes,
                               ddp_kwargs=handlers.get(DistributedDataParallelKwargs))
    else:
        strategy = SingleDeviceStrategy(device, precision, distributed_type, num_processes)
    return precision, strategy
