"""Turn the user's arguments, the launch configuration and the environment into settings and parts.

``resolve_settings`` is pure (no process group, no global state): the Accelerator calls it with its
keyword arguments, the ``HASTEN_LAUNCH_CONFIG`` dict and nothing else, so every precedence rule and
conflict is testable with plain tables. Precedence: explicit arguments and plugin objects > launch
configuration > defaults. When an explicit argument contradicts an explicit launch setting, hasten
raises instead of guessing.
"""

from __future__ import annotations

import dataclasses
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
from hasten.environments.base import ProcessInfo
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


#: Settings only a launcher acts on. A process started by another launcher (plain torchrun, Ray, Kubeflow, python)
#: already exists with its world, so they are not applied from the configuration file there; those that disagree
#: with that world are reported (:func:`apply_config_file`).
LAUNCHER_ONLY = ("num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port",
                 "rdzv_backend", "same_network", "gpu_ids", "min_machines", "mpirun_config", "enable_cpu_affinity")


def apply_config_file(kwargs: Mapping[str, Any], file: LaunchConfig, source: str,
                      world: ProcessInfo | None = None) -> tuple[LaunchConfig, str | None]:
    """The configuration file as a process not started by ``hasten launch`` applies it, and the one line to report.

    The documented precedence holds: a value given in code (``Accelerator(...)`` arguments and plugins, so also
    ``TrainingArguments``) wins over the file; unlike under ``hasten launch``, where such a conflict is an error,
    the file was not written for this one run, so the run goes on with the code's value and the line names both.
    Launcher-only settings (:data:`LAUNCHER_ONLY`) are not applied; where the file's value disagrees with
    ``world`` (the processes that exist), the line says so.

    Returns:
        The configuration to resolve the run with (a :class:`LaunchConfig`), and one line naming every value
        set in both places with different values (None when there is none).

    Example:
        >>> cfg, line = apply_config_file({"mixed_precision": "fp16"}, LaunchConfig(mixed_precision="bf16"), "f.yaml")
        >>> cfg.mixed_precision, "code wins" in line
        ('no', True)
    """
    defaults = LaunchConfig()
    changes: dict[str, Any] = {key: getattr(defaults, key) for key in LAUNCHER_ONLY}
    reports = _code_over_file(kwargs, file, changes)
    unused = _never_run(file)
    if unused:
        reports.append(f"{', '.join(unused)} {'is' if len(unused) == 1 else 'are'} set in the file, but hasten does "
                       "not run Megatron-LM or TPU launches (`hasten launch` refuses them): not applied")
    if world is not None:
        reports += _world_mismatches(file, world)
    config = dataclasses.replace(file, **changes)
    if not reports:
        return config, None
    return config, (f"hasten: the configuration file {source} and this run disagree: " + "; ".join(reports)
                    + " (precedence: Accelerator(...) arguments > configuration file; the launcher decides the "
                    "processes)")


def _code_over_file(kwargs: Mapping[str, Any], file: LaunchConfig, changes: dict[str, Any]) -> list[str]:
    """The file's values that the code's replace (reported), removed from the file through ``changes``."""
    reports: list[str] = []
    code_precision = kwargs.get("mixed_precision")
    if code_precision is not None:
        value = str(getattr(code_precision, "value", code_precision)).lower()
        if file.mixed_precision not in (None, "no", value):
            reports.append(f"mixed_precision is {file.mixed_precision!r} in the file and {value!r} in code: code wins")
            changes["mixed_precision"] = "no"
    code_dynamo = kwargs.get("dynamo_plugin") or kwargs.get("dynamo_backend")
    file_dynamo = str(file.dynamo_config.get("dynamo_backend") or "no").upper()
    if code_dynamo is not None and file_dynamo != "NO":
        named = str(getattr(code_dynamo, "backend", getattr(code_dynamo, "value", code_dynamo))).upper()
        if named != file_dynamo:
            reports.append(f"dynamo_backend is {file_dynamo!r} in the file and {named!r} in code: code wins")
        changes["dynamo_config"] = {}
    engine = _file_engine(file)
    code_engine = ("fsdp_plugin" if kwargs.get("fsdp_plugin") is not None else
                   "deepspeed_plugin" if kwargs.get("deepspeed_plugin") is not None else None)
    if code_engine is not None and engine is not None:
        reports.append(f"the engine is {engine} in the file and Accelerator({code_engine}=...) in code: code wins")
        changes.update(distributed_type="NO", fsdp_config={}, deepspeed_config={})
    elif engine == "DeepSpeed (deepspeed_config)":
        steps = file.deepspeed_config.get("gradient_accumulation_steps")
        plugin = kwargs.get("gradient_accumulation_plugin")
        code_steps = kwargs.get("gradient_accumulation_steps", 1)
        if plugin is not None and getattr(plugin, "num_steps", None) is not None:
            code_steps = plugin.num_steps
        if code_steps != 1 and str(steps).strip().isdigit() and int(str(steps)) != code_steps:
            reports.append(f"gradient_accumulation_steps is {steps} in the file (deepspeed_config) and {code_steps} "
                           "in code: code wins")
            changes["deepspeed_config"] = {k: v for k, v in file.deepspeed_config.items()
                                           if k != "gradient_accumulation_steps"}
    reports += _parallelism_over_file(kwargs.get("parallelism_config"), file, changes)
    return reports


def _never_run(file: LaunchConfig) -> list[str]:
    """The file's Megatron-LM and TPU settings (refused by ``hasten launch``; a worker reports them)."""
    keys = [key for key in ("megatron_lm_config", "tpu_name", "tpu_zone", "tpu_use_cluster", "tpu_use_sudo", "tpu_vm",
                            "tpu_env", "command_file", "commands", "downcast_bf16") if getattr(file, key)]
    return keys + (["main_training_function"] if file.main_training_function != "main" else [])


def _file_engine(file: LaunchConfig) -> str | None:
    if file.distributed_type == "DEEPSPEED":
        return "DeepSpeed (deepspeed_config)"
    if file.distributed_type == "FSDP" or file.fsdp_config:
        return "FSDP (fsdp_config)"
    return None


def _parallelism_over_file(code: Any, file: LaunchConfig, changes: dict[str, Any]) -> list[str]:
    """Sizes set both in a ``ParallelismConfig`` and in the file's ``parallelism_config`` block, differently."""
    if code is None or not file.parallelism_config:
        return []
    from hasten.config.parallelism import parallelism_config_from_launch

    sizes = parallelism_config_from_launch({"parallelism_config": file.parallelism_config})
    unset = getattr(code, "_unset", ())
    reports = [f"parallelism_config.{name} is {getattr(sizes, name)} in the file and {getattr(code, name)} in code: "
               "code wins" for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size")
               if sizes is not None and name not in unset and getattr(code, name) != getattr(sizes, name)
               and f"parallelism_config_{name}" in file.parallelism_config]
    return reports


def _world_mismatches(file: LaunchConfig, world: ProcessInfo) -> list[str]:
    """The file's launcher-only values that disagree with the processes that exist (they are not applied)."""
    reports: list[str] = []
    if file.num_processes is not None and file.num_processes != world.world_size:
        reports.append(f"num_processes is {file.num_processes} in the file but this run has {world.world_size} "
                       f"process{'es' if world.world_size != 1 else ''}: the launcher's count is used")
    machines = max(world.world_size // max(world.local_world_size, 1), 1)
    if file.num_machines != machines:
        reports.append(f"num_machines is {file.num_machines} in the file but this run has {machines}: the "
                       "launcher's count is used")
    elif machines > 1 and file.machine_rank != world.node_rank:
        reports.append(f"machine_rank is {file.machine_rank} in the file but this machine is {world.node_rank}: the "
                       "launcher's rank is used")
    return reports


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
