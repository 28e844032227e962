"""``LaunchConfig``: the configuration file format, with Accelerate's YAML keys.

An Accelerate ``default_config.yaml`` loads as it is; hasten writes files Accelerate can read back
(same keys, ``None`` values and empty blocks left out). Unlike Accelerate, the nested blocks
(``fsdp_config``, ``deepspeed_config``, ...) are checked too, so a typo fails at load time with a
did-you-mean instead of being ignored by the worker.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hasten.base.environment import as_bool
from hasten.exceptions import ConfigurationError

DISTRIBUTED_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA",
                     "MULTI_XPU", "MULTI_HPU", "MULTI_NEURON", "DEEPSPEED", "FSDP", "XLA", "MEGATRON_LM")
MIXED_PRECISIONS = ("no", "fp16", "bf16", "fp8")
COMPUTE_ENVIRONMENTS = ("LOCAL_MACHINE", "AMAZON_SAGEMAKER")
RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")


@dataclass(frozen=True)
class BlockKey:
    """One key of a nested launch block (``fsdp_config``, ``deepspeed_config``): the single place it is listed.

    The YAML loader accepts it, ``hasten launch --<name>`` sets it (when ``flag``), and the worker hands it
    to the plugin keyword ``plugin_field``. ``plugin_field=None`` marks a key the launcher reads itself.
    """

    name: str
    plugin_field: str | None
    flag: bool = True
    choices: tuple[str, ...] = ()
    help: str = ""


FSDP_KEYS: tuple[BlockKey, ...] = (
    BlockKey("fsdp_version", "fsdp_version", choices=("1", "2"),
             help="FSDP version: 2 (FSDP2, fully_shard); 1 is refused with its FSDP2 equivalent."),
    BlockKey("fsdp_auto_wrap_policy", "auto_wrap_policy"),
    BlockKey("fsdp_transformer_layer_cls_to_wrap", "transformer_cls_names_to_wrap"),
    BlockKey("fsdp_min_num_params", "min_num_params"),
    BlockKey("fsdp_backward_prefetch", "backward_prefetch"),
    # Accelerate < 0.20 spelling of fsdp_backward_prefetch (files only, no flag).
    BlockKey("fsdp_backward_prefetch_policy", "backward_prefetch", flag=False),
    BlockKey("fsdp_forward_prefetch", "forward_prefetch"),
    BlockKey("fsdp_cpu_ram_efficient_loading", "cpu_ram_efficient_loading"),
    BlockKey("fsdp_offload_params", "cpu_offload"),
    BlockKey("fsdp_reshard_after_forward", "reshard_after_forward"),
    BlockKey("fsdp_sharding_strategy", "sharding_strategy"),
    BlockKey("fsdp_state_dict_type", "state_dict_type"),
    BlockKey("fsdp_sync_module_states", "sync_module_states"),
    BlockKey("fsdp_use_orig_params", "use_orig_params"),
    BlockKey("fsdp_activation_checkpointing", "activation_checkpointing"),
    BlockKey("fsdp_activation_checkpointing_offload", "activation_checkpointing_offload"),
    BlockKey("fsdp_ignored_modules", "ignored_modules", flag=False),
)
DEEPSPEED_KEYS: tuple[BlockKey, ...] = (
    BlockKey("deepspeed_config_file", "hf_ds_config"),
    # DeepSpeed's own multi-node launcher (pdsh, openmpi, ...): hasten runs torchrun's agent on each machine.
    BlockKey("deepspeed_hostfile", None),
    BlockKey("deepspeed_multinode_launcher", None),
    BlockKey("deepspeed_inclusion_filter", None),
    BlockKey("deepspeed_exclusion_filter", None),
    BlockKey("deepspeed_moe_layer_cls_names", "transformer_moe_cls_names"),
    BlockKey("gradient_accumulation_steps", "gradient_accumulation_steps"),
    BlockKey("gradient_clipping", "gradient_clipping"),
    BlockKey("zero_stage", "zero_stage"),
    BlockKey("offload_optimizer_device", "offload_optimizer_device"),
    BlockKey("offload_optimizer_nvme_path", "offload_optimizer_nvme_path"),
    BlockKey("offload_param_device", "offload_param_device"),
    BlockKey("offload_param_nvme_path", "offload_param_nvme_path"),
    BlockKey("zero3_init_flag", "zero3_init_flag"),
    BlockKey("zero3_save_16bit_model", "zero3_save_16bit_model"),
)

# Keys of the nested blocks, as Accelerate's questionnaire and launcher write them.
BLOCK_KEYS: dict[str, tuple[str, ...]] = {
    "fsdp_config": tuple(key.name for key in FSDP_KEYS),
    "deepspeed_config": tuple(key.name for key in DEEPSPEED_KEYS),
    "dynamo_config": ("dynamo_backend", "dynamo_mode", "dynamo_use_fullgraph", "dynamo_use_dynamic",
                      "dynamo_use_regional_compilation"),
    # Accelerate writes both spellings: the questionnaire `amax_history_length`, the launcher and the recipe
    # kwargs `amax_history_len` (likewise amax_compute_algo(rithm) and opt_level / optimization_level).
    "fp8_config": ("backend", "fp8_format", "margin", "interval", "amax_history_length", "amax_history_len",
                   "amax_compute_algorithm", "amax_compute_algo", "override_linear_precision",
                   "use_autocast_during_eval", "optimization_level", "opt_level", "enable_fsdp_float8_all_gather",
                   "pad_inner_dim", "use_mxfp8_block_scaling"),
    "mpirun_config": ("mpirun_hostfile", "mpirun_ccl"),
}
# Blocks whose keys are open-ended but share a prefix.
BLOCK_PREFIXES = {"megatron_lm_config": "megatron_lm_", "parallelism_config": "parallelism_config_"}

# Keys that only a SageMaker configuration has: such files are refused with a clear message.
_SAGEMAKER_ONLY = ("ec2_instance_type", "iam_role_name", "image_uri", "profile", "region", "base_job_name",
                   "pytorch_version", "transformers_version", "py_version", "sagemaker_inputs_file",
                   "sagemaker_metrics_file", "additional_args")


def _kind(kind: str, choices: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"kind": kind, "choices": choices}


#: Upper bound on processes and machines (torch's ranks are 32-bit; no run comes near this).
MAX_PROCESSES = 1 << 20


@dataclass
class LaunchConfig:
    """The launch configuration: Accelerate's config file keys, validated.

    ``num_processes=None`` means "not set": ``hasten launch`` fills it from the command line or the
    hardware. The nested blocks are plain dicts of Accelerate's keys (for example ``fsdp_config``
    holds ``fsdp_version``, ``fsdp_reshard_after_forward``, ...).

    Example:
        >>> cfg = LaunchConfig.from_dict({"distributed_type": "MULTI_CPU", "num_processes": 2, "use_cpu": True})
        >>> cfg.num_processes, cfg.to_dict()["distributed_type"]
        (2, 'MULTI_CPU')
    """

    compute_environment: str = field(default="LOCAL_MACHINE", metadata=_kind("choice", COMPUTE_ENVIRONMENTS))
    distributed_type: str = field(default="NO", metadata=_kind("choice", DISTRIBUTED_TYPES))
    mixed_precision: str = field(default="no", metadata=_kind("choice", MIXED_PRECISIONS))
    use_cpu: bool = field(default=False, metadata=_kind("bool"))
    debug: bool = field(default=False, metadata=_kind("bool"))
    num_processes: int | None = field(default=None, metadata=_kind("int"))
    machine_rank: int = field(default=0, metadata=_kind("int"))
    num_machines: int = field(default=1, metadata=_kind("int"))
    gpu_ids: str | None = field(default=None, metadata=_kind("ids"))
    main_process_ip: str | None = field(default=None, metadata=_kind("str"))
    main_process_port: int | None = field(default=None, metadata=_kind("int"))
    rdzv_backend: str = field(default="static", metadata=_kind("choice", RDZV_BACKENDS))
    same_network: bool = field(default=False, metadata=_kind("bool"))
    main_training_function: str = field(default="main", metadata=_kind("str"))
    enable_cpu_affinity: bool = field(default=False, metadata=_kind("bool"))
    downcast_bf16: bool = field(default=False, metadata=_kind("bool"))
    fp8_config: dict[str, Any] = field(default_factory=dict, metadata=_kind("block"))
    deepspeed_config: dict[str, Any] = field(default_factory=dict, metadata=_kind("block"))
    fsdp_config: dict[str, Any] = field(default_factory=dict, metadata=_kind("block"))
    parallelism_config: dict[str, Any] = field(default_factory=dict, metadata=_kind("block"))
    megatron_lm_config: dict[str, Any] = field(default_factory=dict, metadata=_kind("block"))
    mpirun_config: dict[str, Any] = field(default_factory=dict, metadata=_kind("block"))
    dynamo_config: dict[str, Any] = field(default_factory=dict, metadata=_kind("block"))
    tpu_name: str | None = field(default=None, metadata=_kind("str"))
    tpu_zone: str | None = field(default=None, metadata=_kind("str"))
    tpu_use_cluster: bool = field(default=False, metadata=_kind("bool"))
    tpu_use_sudo: bool = field(default=False, metadata=_kind("bool"))
    command_file: str | None = field(default=None, metadata=_kind("str"))
    commands: list[str] | None = field(default=None, metadata=_kind("list"))
    tpu_vm: list[str] | None = field(default=None, metadata=_kind("list"))
    tpu_env: list[str] | None = field(default=None, metadata=_kind("list"))
    # None = not set, so files hasten writes stay readable by Accelerate versions without the key.
    use_parallelism_config: bool | None = field(default=None, metadata=_kind("bool"))
    # hasten's own key (``--num_machines MIN:MAX``): the run goes on while at least this many machines
    # remain; None = a fixed set of num_machines (the file stays Accelerate's when it is not set).
    min_machines: int | None = field(default=None, metadata=_kind("int"))
    # hasten's own key (``--preemption_signal``): the signal that makes every worker stop at the same step,
    # checkpoint and exit (None = SIGTERM; e.g. USR1 for SLURM's ``--signal=USR1@90``).
    preemption_signal: str | None = field(default=None, metadata=_kind("str"))
    # hasten's own key (``--replica_groups N``): per-step fault tolerance over N replica groups (torchft);
    # None = off.
    replica_groups: int | None = field(default=None, metadata=_kind("int"))

    # ------------------------------------------------------------------------------------ conversion
    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "the configuration",
                  lines: Mapping[str, int] | None = None) -> LaunchConfig:
        """Build and validate a configuration from a mapping of Accelerate's keys.

        Args:
            data: the file's top-level mapping.
            source: where it came from (a file path), used in error messages.
            lines: optional line number of each top-level key, used in error messages.

        Raises:
            ConfigurationError: unknown keys (with a did-you-mean), wrong types, invalid values.

        Example:
            >>> LaunchConfig.from_dict({"distributed_type": "NO", "fp16": True}).mixed_precision
            'fp16'
        """
        if not isinstance(data, Mapping):
            raise ConfigurationError(f"{source} must hold a mapping of keys to values, got {type(data).__name__}. "
                                     "HINT: regenerate it with `hasten config`.")
        raw = _upgrade_legacy(dict(data))
        where = _locator(source, lines or {})
        if raw.get("compute_environment") == "AMAZON_SAGEMAKER" or any(k in raw for k in _SAGEMAKER_ONLY):
            raise ConfigurationError(f"{where('compute_environment')}: Amazon SageMaker launches are not supported "
                                     "by hasten. HINT: use compute_environment: LOCAL_MACHINE and launch on the "
                                     "instances with `hasten launch`.")
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ConfigurationError(_unknown_message(unknown, known, where, "the file"))
        values = {name: _coerce(name, value, known[name].metadata, where) for name, value in raw.items()}
        config = cls(**values)
        config.validate(source)
        return config

    @classmethod
    def from_launch_dict(cls, data: Mapping[str, Any], source: str = "HASTEN_LAUNCH_CONFIG") -> LaunchConfig:
        """Parse what :meth:`to_launch_dict` wrote (the worker's ``HASTEN_LAUNCH_CONFIG``) back into a config.

        ``None`` values mean "not set" and take the field's default; every other key is validated as a
        file key would be, so a launch dict that does not match the schema fails loudly in the worker.

        Example:
            >>> cfg = LaunchConfig(num_processes=2, use_cpu=True)
            >>> LaunchConfig.from_launch_dict(cfg.to_launch_dict()) == cfg
            True
        """
        if not isinstance(data, Mapping):
            raise ConfigurationError(f"{source} must hold a mapping of keys to values, got {type(data).__name__}.")
        return cls.from_dict({k: v for k, v in data.items() if v is not None}, source=source)

    def to_dict(self) -> dict[str, Any]:
        """The file form: like Accelerate, ``None`` values and empty blocks are left out.

        Example:
            >>> "fsdp_config" in LaunchConfig().to_dict()
            False
        """
        return {k: v for k, v in self.to_launch_dict().items() if v is not None and v != {}}

    def to_launch_dict(self) -> dict[str, Any]:
        """Every key with its value (blocks as plain dicts): what workers receive as JSON."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def replace(self, **changes: Any) -> LaunchConfig:
        """A validated copy with some keys changed (values are coerced like file values)."""
        data = self.to_launch_dict()
        data.update(changes)
        return LaunchConfig.from_dict({k: v for k, v in data.items() if v is not None}, source="the command line")

    # ------------------------------------------------------------------------------------ validation
    def validate(self, source: str = "the configuration") -> None:
        """Check values that depend on each other; raise ``ConfigurationError`` naming the fix."""
        if self.num_processes is not None and self.num_processes <= 0:
            raise ConfigurationError(f"{source}: num_processes={self.num_processes} must be at least 1. "
                                     "HINT: pass --num_processes N with N >= 1.")
        if self.num_processes is not None and self.num_processes > MAX_PROCESSES:
            raise ConfigurationError(f"{source}: num_processes={self.num_processes} is more than any run can start "
                                     f"(at most {MAX_PROCESSES}).")
        if not 1 <= self.num_machines <= MAX_PROCESSES:
            raise ConfigurationError(f"{source}: num_machines={self.num_machines} must be in 1..{MAX_PROCESSES}.")
        if not 0 <= self.machine_rank < self.num_machines:
            raise ConfigurationError(
                f"{source}: machine_rank={self.machine_rank} must be in 0..{self.num_machines - 1} because "
                f"num_machines={self.num_machines}. HINT: number the machines 0, 1, ... and pass --machine_rank.")
        if self.min_machines is not None and not 1 <= self.min_machines <= self.num_machines:
            raise ConfigurationError(f"{source}: min_machines={self.min_machines} must be in 1..num_machines="
                                     f"{self.num_machines}. HINT: --num_machines MIN:MAX with MIN <= MAX.")
        if self.preemption_signal is not None and not _is_signal_name(self.preemption_signal):
            raise ConfigurationError(f"{source}: preemption_signal={self.preemption_signal!r} is not a signal. "
                                     "HINT: name one such as TERM, USR1 or SIGUSR2.")
        if self.replica_groups is not None and not 1 <= self.replica_groups <= MAX_PROCESSES:
            raise ConfigurationError(f"{source}: replica_groups={self.replica_groups} must be in 1..{MAX_PROCESSES}. "
                                     "HINT: --replica_groups N with N dividing --num_processes.")
        if self.main_process_port is not None and not 0 <= self.main_process_port <= 65535:
            raise ConfigurationError(f"{source}: main_process_port={self.main_process_port} is not a TCP port "
                                     "(0..65535; 0 picks a free one).")
        if self.use_cpu and self.gpu_ids not in (None, "all"):
            raise ConfigurationError(f"{source}: use_cpu=True conflicts with gpu_ids={self.gpu_ids!r}. "
                                     "HINT: drop --gpu_ids for a CPU run, or drop --cpu to use those GPUs.")
        for name, block in self.blocks().items():
            _check_block(name, block, source)

    def blocks(self) -> dict[str, dict[str, Any]]:
        """The nested configuration blocks by key."""
        return {name: getattr(self, name) for name in (*BLOCK_KEYS, *BLOCK_PREFIXES)}


# ---------------------------------------------------------------------------------------------- helpers
def _is_signal_name(name: str) -> bool:
    import signal

    text = str(name).strip().upper()
    return text.isdigit() and 0 < int(text) < signal.NSIG or (text if text.startswith("SIG") else "SIG" + text) \
        in signal.Signals.__members__

def _locator(source: str, lines: Mapping[str, int]) -> Any:
    def where(key: str) -> str:
        line = lines.get(key)
        return f"{source}, line {line}" if line else source
    return where


def _unknown_message(unknown: list[str], known: Mapping[str, Any], where: Any, place: str) -> str:
    parts = []
    for key in unknown:
        guess = difflib.get_close_matches(key, list(known), n=1)
        hint = f" (did you mean {guess[0]!r}?)" if guess else ""
        parts.append(f"{where(key)}: unknown key {key!r}{hint}")
    return ("; ".join(parts) + f". Remove or rename the key{'s' if len(unknown) > 1 else ''} in {place}; "
            "`hasten config update` rewrites an old file with the current keys.")


def _upgrade_legacy(raw: dict[str, Any]) -> dict[str, Any]:
    # Accelerate < 0.15 wrote `fp16: true` and a top-level `dynamo_backend`; both are still accepted.
    if "fp16" in raw:
        fp16 = raw.pop("fp16")
        raw.setdefault("mixed_precision", "fp16" if as_bool(fp16, "fp16") else "no")
    if "dynamo_backend" in raw:
        backend = raw.pop("dynamo_backend")
        if str(backend).upper() != "NO":
            raw.setdefault("dynamo_config", {"dynamo_backend": backend})
    if raw.get("mixed_precision") is None:
        raw.pop("mixed_precision", None)
    if raw.get("num_processes") == -1:  # Accelerate's "not set" marker
        raw.pop("num_processes")
    return raw


def _coerce(key: str, value: Any, meta: Mapping[str, Any], where: Any) -> Any:
    kind, choices = meta["kind"], meta["choices"]
    if value is None:
        return {} if kind == "block" else None
    try:
        if kind == "bool":
            return as_bool(value, key)
        if kind == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if kind == "choice":
            text = str(value)
            match = next((c for c in choices if c.lower() == text.lower()), None)
            if match is None:
                raise ValueError
            return match
        if kind == "ids":
            return ",".join(str(v) for v in value) if isinstance(value, list) else str(value)
        if kind == "block":
            if not isinstance(value, Mapping):
                raise ValueError
            return dict(value)
        if kind == "list":
            return [str(v) for v in value] if isinstance(value, list) else [str(value)]
        return str(value)
    except (TypeError, ValueError):
        expected = {"bool": "true or false", "int": "an integer", "block": "a mapping of keys to values",
                    "choice": f"one of {list(choices)}"}.get(kind, "a string")
        raise ConfigurationError(f"{where(key)}: {key}={value!r} is not valid; expected {expected}.") from None


def _check_block(name: str, block: Mapping[str, Any], source: str) -> None:
    if name in BLOCK_PREFIXES:
        prefix = BLOCK_PREFIXES[name]
        bad = sorted(k for k in block if not str(k).startswith(prefix))
        if bad:
            raise ConfigurationError(f"{source}: keys {bad} in {name} must start with {prefix!r}.")
        return
    allowed = BLOCK_KEYS[name]
    # FSDP keys may be written without their prefix (Accelerate accepts both spellings).
    prefix = "fsdp_" if name == "fsdp_config" else ""
    unknown = sorted(k for k in block if k not in allowed and f"{prefix}{k}" not in allowed)
    if unknown:
        raise ConfigurationError(_unknown_message(unknown, dict.fromkeys(allowed), lambda k: f"{source} [{name}]",
                                                  f"the {name} block"))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def parse_machine_count(text: str) -> tuple[int | None, int]:
    """``--num_machines``: ``"N"`` -> ``(None, N)``; ``"MIN:MAX"`` -> ``(MIN, MAX)`` (an elastic run).

    Raises:
        ConfigurationError: not a count or a ``MIN:MAX`` pair of counts.

    Example:
        >>> parse_machine_count("2:3"), parse_machine_count("4")
        ((2, 3), (None, 4))
    """
    low, sep, high = str(text).partition(":")
    try:
        counts = (int(low), int(high)) if sep else (None, int(low))
    except ValueError:
        raise ConfigurationError(f"--num_machines {text!r} must be a number of machines N or a range MIN:MAX "
                                 "(for example 2:4: go on while at least 2 of up to 4 machines remain).") from None
    if counts[0] is not None and counts[0] == counts[1]:
        return None, counts[1]
    return counts
