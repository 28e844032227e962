"""The one reader of ``HASTEN_*`` variables.

``hasten launch`` passes a single variable, ``HASTEN_LAUNCH_CONFIG`` (JSON of the launch configuration),
plus torchrun's standard variables. A few switches are also honoured on their own so that plain
``python``/``torchrun`` users can set them: ``HASTEN_DEBUG_MODE``, ``HASTEN_LOG_LEVEL`` and
``HASTEN_COLLECTIVE_TIMEOUT`` (seconds; what ``hasten launch --collective_timeout`` sets). A process started
by any other launcher reads the configuration file instead (:func:`worker_config_file`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from hasten.base.environment import as_bool
from hasten.config.io import find_config_file, load_config_file
from hasten.config.schema import LaunchConfig

LAUNCH_CONFIG_VAR = "HASTEN_LAUNCH_CONFIG"
DEBUG_MODE_VAR = "HASTEN_DEBUG_MODE"
LOG_LEVEL_VAR = "HASTEN_LOG_LEVEL"
COLLECTIVE_TIMEOUT_VAR = "HASTEN_COLLECTIVE_TIMEOUT"
#: Set by ``hasten launch`` (torchrun agent): where workers stopped by preemption leave a marker file.
PREEMPTION_DIR_VAR = "HASTEN_PREEMPTION_DIR"
#: ``hasten launch --replica_groups N``: the fault-tolerance settings (JSON), this process's group, the number of
#: groups, and torchft's own Lighthouse address variable (``http://host:port``).
FAULT_TOLERANCE_VAR = "HASTEN_FAULT_TOLERANCE"
REPLICA_GROUP_VAR = "HASTEN_REPLICA_GROUP"
NUM_REPLICA_GROUPS_VAR = "HASTEN_NUM_REPLICA_GROUPS"
LIGHTHOUSE_VAR = "TORCHFT_LIGHTHOUSE"


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def launch_config_dict(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The launch configuration passed by ``hasten launch`` as a plain dict ({} when absent)."""
    raw = _env(env).get(LAUNCH_CONFIG_VAR)
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{LAUNCH_CONFIG_VAR} is not valid JSON ({exc}); it is written by `hasten launch`, "
                         "unset it if you set it by hand") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{LAUNCH_CONFIG_VAR} must hold a JSON object, got {type(value).__name__}")
    return value


def accelerate_torch_device(env: Mapping[str, str] | None = None) -> str | None:
    """Accelerate's ``ACCELERATE_TORCH_DEVICE`` (a device such as ``"cpu:64"`` that overrides the chosen
    one), or None when unset."""
    return _env(env).get("ACCELERATE_TORCH_DEVICE") or None


def accelerate_parallelism_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Accelerate's ``PARALLELISM_CONFIG_*`` variables (its launcher's channel for ``ParallelismConfig``), as
    ``parallelism_config_*`` keys of a launch configuration's ``parallelism_config`` block."""
    prefix = "PARALLELISM_CONFIG_"
    return {f"parallelism_config_{key[len(prefix):].lower()}": value for key, value in _env(env).items()
            if key.startswith(prefix)}


def launch_config(env: Mapping[str, str] | None = None) -> LaunchConfig | None:
    """The typed launch configuration passed by ``hasten launch`` (``None`` when not launched by it).

    Raises:
        ConfigurationError: the variable does not match the ``LaunchConfig`` schema.
    """
    data = launch_config_dict(env)
    return LaunchConfig.from_launch_dict(data) if data else None


#: Parsed configuration files by (path, modification time, size): a worker reads its file once.
_FILE_CACHE: dict[tuple[str, int, int], LaunchConfig] = {}


def worker_config_file(env: Mapping[str, str] | None = None) -> tuple[Path, LaunchConfig] | None:
    """The configuration file a process not started by ``hasten launch`` applies, and its content.

    Workers of ``hasten launch`` receive the configuration in ``HASTEN_LAUNCH_CONFIG`` (None here). Any other
    process (plain ``torchrun``, Ray, Kubeflow, ``python``) reads the file ``hasten launch`` would read:
    ``ACCELERATE_CONFIG_FILE``, else the default file (:func:`hasten.config.io.find_config_file`); None when
    there is none.

    Raises:
        ConfigurationError: ``ACCELERATE_CONFIG_FILE`` names no file, or the file is malformed.
    """
    env = _env(env)
    if env.get(LAUNCH_CONFIG_VAR):
        return None
    path = find_config_file(None, env)
    if path is None:
        return None
    stat = path.stat()
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    if key not in _FILE_CACHE:
        _FILE_CACHE.clear()
        _FILE_CACHE[key] = load_config_file(path)
    return path, _FILE_CACHE[key]


def worker_launch_dict(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The launch configuration of this process as a dict: ``HASTEN_LAUNCH_CONFIG``, else the configuration file
    of :func:`worker_config_file` ({} when neither)."""
    launched = launch_config_dict(env)
    if launched:
        return launched
    found = worker_config_file(env)
    return found[1].to_launch_dict() if found is not None else {}


def launch_config_to_env(config: Mapping[str, Any]) -> dict[str, str]:
    """Encode a launch configuration for a worker's environment: ``HASTEN_LAUNCH_CONFIG`` and, derived from the
    same configuration, the ``ACCELERATE_*`` / ``FSDP_*`` variables ``accelerate launch`` exports (which
    Transformers' ``TrainingArguments`` reads, e.g. ``ACCELERATE_MIXED_PRECISION``)."""
    return {LAUNCH_CONFIG_VAR: json.dumps(dict(config), sort_keys=True), **accelerate_launch_env(config)}


def _flag(value: Any) -> str:
    return str(bool(value)).lower() if isinstance(value, bool) or value is None else str(value).lower()


def _listed(value: Any) -> str:
    return ",".join(str(v) for v in value) if isinstance(value, (list, tuple)) else str(value)


# FSDP's variables and the values `accelerate launch` gives them when the configuration leaves them out.
_FSDP_FLAGS = {"FSDP_RESHARD_AFTER_FORWARD": ("fsdp_reshard_after_forward", True),
               "FSDP_OFFLOAD_PARAMS": ("fsdp_offload_params", False),
               "FSDP_FORWARD_PREFETCH": ("fsdp_forward_prefetch", False),
               "FSDP_USE_ORIG_PARAMS": ("fsdp_use_orig_params", True),
               "FSDP_CPU_RAM_EFFICIENT_LOADING": ("fsdp_cpu_ram_efficient_loading", True),
               "FSDP_SYNC_MODULE_STATES": ("fsdp_sync_module_states", True),
               "FSDP_ACTIVATION_CHECKPOINTING": ("fsdp_activation_checkpointing", False),
               "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": ("fsdp_activation_checkpointing_offload", False)}
_FSDP_OPTIONAL = {"FSDP_AUTO_WRAP_POLICY": "fsdp_auto_wrap_policy",
                  "FSDP_TRANSFORMER_CLS_TO_WRAP": "fsdp_transformer_layer_cls_to_wrap",
                  "FSDP_BACKWARD_PREFETCH": "fsdp_backward_prefetch", "FSDP_STATE_DICT_TYPE": "fsdp_state_dict_type",
                  "FSDP_IGNORED_MODULES": "fsdp_ignored_modules"}
_DEEPSPEED: dict[str, tuple[str, Callable[[Any], str]]] = {"ACCELERATE_DEEPSPEED_ZERO_STAGE": ("zero_stage", str),
              "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": ("gradient_accumulation_steps", str),
              "ACCELERATE_GRADIENT_CLIPPING": ("gradient_clipping", _flag),
              "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": ("offload_optimizer_device", _flag),
              "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": ("offload_param_device", _flag),
              "ACCELERATE_DEEPSPEED_ZERO3_INIT": ("zero3_init_flag", _flag),
              "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": ("zero3_save_16bit_model", _flag),
              "ACCELERATE_DEEPSPEED_CONFIG_FILE": ("deepspeed_config_file", str),
              "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES": ("deepspeed_moe_layer_cls_names", str)}


# Accelerate starts these with its multi-GPU or DeepSpeed launcher, which does not export ACCELERATE_USE_CPU.
_OWN_LAUNCHERS = ("MULTI_GPU", "FSDP", "DEEPSPEED")


def accelerate_launch_env(config: Mapping[str, Any]) -> dict[str, str]:
    """The ``ACCELERATE_*`` / ``FSDP_*`` variables ``accelerate launch`` exports for ``config``, with its values.

    Libraries written for Accelerate read them in the worker (Transformers' ``TrainingArguments`` takes its
    ``mixed_precision`` from ``ACCELERATE_MIXED_PRECISION``); hasten itself reads only ``HASTEN_LAUNCH_CONFIG``.

    Example:
        >>> accelerate_launch_env({"mixed_precision": "bf16", "use_cpu": True})["ACCELERATE_MIXED_PRECISION"]
        'bf16'
    """
    dynamo = config.get("dynamo_config") or {}
    distributed = str(config.get("distributed_type") or "")
    env = {} if distributed in _OWN_LAUNCHERS else {"ACCELERATE_USE_CPU": str(bool(config.get("use_cpu")))}
    env.update({"ACCELERATE_MIXED_PRECISION": str(config.get("mixed_precision") or "no").lower(),
           "ACCELERATE_DYNAMO_BACKEND": str(dynamo.get("dynamo_backend") or "no").upper(),
           "ACCELERATE_DYNAMO_MODE": str(dynamo.get("dynamo_mode") or "default"),
           "ACCELERATE_DYNAMO_USE_FULLGRAPH": str(bool(dynamo.get("dynamo_use_fullgraph"))),
           "ACCELERATE_DYNAMO_USE_DYNAMIC": str(bool(dynamo.get("dynamo_use_dynamic"))),
           "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": str(bool(dynamo.get("dynamo_use_regional_compilation")))})
    if config.get("debug"):
        env["ACCELERATE_DEBUG_MODE"] = "true"
    if config.get("enable_cpu_affinity"):
        env["ACCELERATE_CPU_AFFINITY"] = "1"
    fsdp = config.get("fsdp_config") or {}
    if distributed == "FSDP":
        env["ACCELERATE_USE_FSDP"] = "true"
        env["FSDP_VERSION"] = str(fsdp.get("fsdp_version") or 2)
        env["FSDP_SHARDING_STRATEGY"] = str(fsdp.get("fsdp_sharding_strategy") or "FULL_SHARD")
        env["FSDP_MIN_NUM_PARAMS"] = str(int(fsdp.get("fsdp_min_num_params") or 100_000_000))
        for variable, (key, default) in _FSDP_FLAGS.items():
            env[variable] = _flag(fsdp.get(key, default))
        for variable, key in _FSDP_OPTIONAL.items():
            if fsdp.get(key) is not None:
                env[variable] = _listed(fsdp[key])
    deepspeed = config.get("deepspeed_config") or {}
    if distributed == "DEEPSPEED":
        env["ACCELERATE_USE_DEEPSPEED"] = "true"
        env["ACCELERATE_CONFIG_DS_FIELDS"] = ",".join(deepspeed).lower()
        for variable, (key, encode) in _DEEPSPEED.items():
            if deepspeed.get(key) is not None:
                env[variable] = encode(deepspeed[key])
    return env


def debug_mode(env: Mapping[str, str] | None = None) -> bool:
    """True when cross-rank checks of collectives are on (``HASTEN_DEBUG_MODE=1``, ``launch --debug`` or the
    configuration file's ``debug``)."""
    env = _env(env)
    raw = env.get(DEBUG_MODE_VAR)
    if raw is not None:
        return as_bool(raw, DEBUG_MODE_VAR) if raw.strip() else False
    return bool(worker_launch_dict(env).get("debug", False))


def log_level(env: Mapping[str, str] | None = None) -> str | None:
    """The level named by ``HASTEN_LOG_LEVEL``, if any."""
    return _env(env).get(LOG_LEVEL_VAR)


def worker_group_restart(env: Mapping[str, str] | None = None) -> int:
    """How many times torchrun's agent restarted this worker group (``TORCHELASTIC_RESTART_COUNT``; 0 if unset)."""
    try:
        return int(_env(env).get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


def test_start_method(env: Mapping[str, str] | None = None) -> str:
    """How the test harness starts ranks: ``fork`` (default, fast) or ``spawn`` (``HASTEN_TEST_START_METHOD``)."""
    return _env(env).get("HASTEN_TEST_START_METHOD", "fork")


def collective_timeout(env: Mapping[str, str] | None = None) -> timedelta | None:
    """The hang bound set by ``hasten launch --collective_timeout`` (``HASTEN_COLLECTIVE_TIMEOUT``, seconds)."""
    raw = _env(env).get(COLLECTIVE_TIMEOUT_VAR)
    if not raw:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds <= 30 * 86400:  # nan and inf fail too; timedelta/torch timers overflow beyond
        raise ValueError(f"{COLLECTIVE_TIMEOUT_VAR}={raw!r} must be a number of seconds above 0 and at most 30 days.")
    return timedelta(seconds=seconds)


def preemption_dir(env: Mapping[str, str] | None = None) -> str | None:
    """The folder where ``hasten launch`` collects the markers of workers stopped by preemption, if any."""
    return _env(env).get(PREEMPTION_DIR_VAR) or None


def preemption_signal(env: Mapping[str, str] | None = None) -> str | None:
    """The preemption signal of the launch configuration (``hasten launch --preemption_signal``), if any."""
    value = worker_launch_dict(env).get("preemption_signal")
    return str(value) if value else None


def rendezvous_store(env: Mapping[str, str] | None = None) -> tuple[str, int] | None:
    """The store this worker's group met on (torchrun's ``MASTER_ADDR``/``MASTER_PORT``), or None outside one."""
    found = _env(env)
    addr, port = found.get("MASTER_ADDR"), found.get("MASTER_PORT")
    return (addr, int(port)) if addr and port and port.isdigit() else None


def replica_group_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of a replica-group launch that are set (fault-tolerance settings, group, groups, Lighthouse)."""
    found = _env(env)
    return {name: found[name] for name in (FAULT_TOLERANCE_VAR, REPLICA_GROUP_VAR, NUM_REPLICA_GROUPS_VAR,
                                           LIGHTHOUSE_VAR) if found.get(name)}
