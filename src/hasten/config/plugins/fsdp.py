"""``FullyShardedDataParallelPlugin`` (Accelerate's FSDP2 fields) and the ``fsdp_config`` launch block.

hasten implements FSDP2 only (``torch.distributed.fsdp.fully_shard``). FSDP1 settings are refused with
the FSDP2 equivalent in the message; :func:`convert_fsdp1_config` (and ``hasten to-fsdp2``) rewrites an
FSDP1 ``fsdp_config`` block. Nothing here reads the environment: Accelerate fills ``None`` fields from
``FSDP_*`` variables, hasten receives them through the launch configuration instead.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hasten.base.environment import as_bool

# DEFAULT_MIN_NUM_PARAMS and ignored_module_list are re-exported from here, their earlier home.
from hasten.config.plugins.fsdp_units import (
    DEFAULT_MIN_NUM_PARAMS,
    UnitPolicy,
    build_wrap_policy,
    ignored_module_list,
)
from hasten.config.schema import FSDP_KEYS, LaunchConfig
from hasten.exceptions import ConfigurationError

#: Auto-wrap policy names (Accelerate's ``FSDP_AUTO_WRAP_POLICY``).
AUTO_WRAP_POLICIES = ("transformer_based_wrap", "size_based_wrap", "no_wrap")
#: State-dict types FSDP2 supports (FSDP1's LOCAL_STATE_DICT has no FSDP2 counterpart).
STATE_DICT_TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT")
#: FSDP1 sharding strategies and the ``reshard_after_forward`` value that does the same under FSDP2.
SHARDING_TO_RESHARD = {"FULL_SHARD": True, "HYBRID_SHARD": True, "SHARD_GRAD_OP": False,
                       "HYBRID_SHARD_ZERO2": False, "NO_SHARD": False}
_SHARDING_NUMBERS = {"1": "FULL_SHARD", "2": "SHARD_GRAD_OP", "3": "NO_SHARD", "4": "HYBRID_SHARD",
                     "5": "HYBRID_SHARD_ZERO2"}
#: FSDP1-only keys of the ``fsdp_config`` block that FSDP2 drops (behaviour it has built in, or lacks).
FSDP1_ONLY_KEYS = ("fsdp_sharding_strategy", "fsdp_backward_prefetch", "fsdp_forward_prefetch",
                   "fsdp_sync_module_states", "fsdp_use_orig_params")
_CONVERT_HINT = ("HINT: hasten runs FSDP2 only; `hasten to-fsdp2 --config_file PATH` converts an FSDP1 config file "
                 "(sharding_strategy FULL_SHARD/HYBRID_SHARD -> reshard_after_forward=True, SHARD_GRAD_OP/NO_SHARD -> "
                 "False; backward_prefetch, forward_prefetch, sync_module_states and use_orig_params are dropped).")


def _as_bool(name: str, value: Any) -> bool:
    return as_bool(value, name, owner="FullyShardedDataParallelPlugin")


def _name_of(value: Any) -> str:
    """Enum members (torch's or Accelerate's) and strings alike, upper-cased."""
    return str(getattr(value, "name", value)).strip().upper()


@dataclass
class FullyShardedDataParallelPlugin:
    """Settings for FSDP2 sharding (``torch.distributed.fsdp.fully_shard`` over a device mesh).

    Field names and defaults are Accelerate's. ``None`` means FSDP2's default: ``fsdp_version=2``,
    ``reshard_after_forward=True``, ``state_dict_type="SHARDED_STATE_DICT"``, no CPU offload, no
    activation checkpointing. FSDP1 settings (``fsdp_version=1``, ``sharding_strategy``,
    ``backward_prefetch``, ``forward_prefetch``) raise ``ConfigurationError`` naming the FSDP2 setting.
    ``use_orig_params``, ``sync_module_states``, ``limit_all_gathers``, ``param_init_fn``,
    ``state_dict_config`` and ``optim_state_dict_config`` are accepted for compatibility and ignored:
    FSDP2 always trains the original parameters, and hasten always copies rank 0's weights to every
    rank when it shards (unlike Accelerate, whose FSDP2 path trusts every rank to hold equal weights).

    Args:
        fsdp_version: 2 (or None). 1 is refused.
        reshard_after_forward: free the gathered parameters after forward (ZeRO-3-like) or keep them
            until backward (ZeRO-2-like, more memory, less communication).
        mixed_precision_policy: a ``torch.distributed.fsdp.MixedPrecisionPolicy``, a dict of its fields
            (dtypes as ``torch.dtype`` or names such as ``"bfloat16"``), or ``"bf16"``/``"fp16"``/``"fp32"``.
            None: derived from the Accelerator's ``mixed_precision``.
        auto_wrap_policy: ``"transformer_based_wrap"``, ``"size_based_wrap"``, ``"no_wrap"`` or a
            callable ``policy(module) -> bool``; which sub-modules become their own FSDP unit.
        cpu_offload: keep sharded parameters, gradients and optimizer state in CPU memory.
        ignored_modules: modules (or a regex matched against module names) left unsharded; their
            gradients are NOT synchronised across processes.
        state_dict_type: how ``save_state`` writes models and optimizers: ``"SHARDED_STATE_DICT"``
            (a ``torch.distributed.checkpoint`` folder per model/optimizer, every rank writes its shard)
            or ``"FULL_STATE_DICT"`` (``model.safetensors`` + ``optimizer.bin``, gathered on rank 0).
        activation_checkpointing: recompute the activations of every wrapped block in backward.
        cpu_ram_efficient_loading: only rank 0 keeps the full weights while sharding; the other ranks
            move theirs to the meta device and receive their shards from rank 0.
        transformer_cls_names_to_wrap: class names for ``transformer_based_wrap`` (default: the model's
            ``_no_split_modules``).
        min_num_params: parameter threshold for ``size_based_wrap`` (default 1e8).

    Example:
        >>> plugin = FullyShardedDataParallelPlugin(auto_wrap_policy="transformer_based_wrap",
        ...                                         transformer_cls_names_to_wrap=["Block"])
        >>> accelerator = Accelerator(fsdp_plugin=plugin)
    """

    fsdp_version: int | None = None
    sharding_strategy: Any = None
    reshard_after_forward: Any = None
    backward_prefetch: Any = None
    mixed_precision_policy: Any = None
    auto_wrap_policy: Any = None
    cpu_offload: Any = None
    ignored_modules: Any = None
    state_dict_type: Any = None
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    limit_all_gathers: bool = True
    use_orig_params: Any = None
    param_init_fn: Callable[..., Any] | None = None
    sync_module_states: Any = None
    forward_prefetch: Any = None
    activation_checkpointing: Any = None
    activation_checkpointing_offload: Any = None
    cpu_ram_efficient_loading: Any = None
    transformer_cls_names_to_wrap: list[str] | None = None
    min_num_params: int | None = None
    _extra: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._refuse_fsdp1()
        self.fsdp_version = 2
        self.reshard_after_forward = self._reshard(self.reshard_after_forward)
        self.activation_checkpointing = _as_bool("activation_checkpointing", self.activation_checkpointing or False)
        if _as_bool("activation_checkpointing_offload", self.activation_checkpointing_offload or False):
            raise ConfigurationError("FullyShardedDataParallelPlugin(activation_checkpointing_offload=True) is not "
                                     "supported by hasten's FSDP2 path; use activation_checkpointing=True (recompute "
                                     "in backward) and cpu_offload=True to save more memory.")
        self.activation_checkpointing_offload = False
        self.cpu_ram_efficient_loading = _as_bool("cpu_ram_efficient_loading", self.cpu_ram_efficient_loading or False)
        self.set_state_dict_type(self.state_dict_type)
        self._normalise_wrap_policy()
        self.validate_cpu_offload()

    # --------------------------------------------------------------------------------- validation
    def _refuse_fsdp1(self) -> None:
        if self.fsdp_version not in (None, 2, "2"):
            raise ConfigurationError(f"FullyShardedDataParallelPlugin(fsdp_version={self.fsdp_version!r}): hasten "
                                     "implements FSDP2 only; use fsdp_version=2 (the default). " + _CONVERT_HINT)
        if self.sharding_strategy is not None:
            name = _SHARDING_NUMBERS.get(str(self.sharding_strategy), _name_of(self.sharding_strategy))
            equivalent = SHARDING_TO_RESHARD.get(name)
            fix = (f"use reshard_after_forward={equivalent} instead" if equivalent is not None
                   else "use reshard_after_forward=True/False instead")
            raise ConfigurationError(f"FullyShardedDataParallelPlugin(sharding_strategy={self.sharding_strategy!r}) is "
                                     f"an FSDP1 setting: {fix}. " + _CONVERT_HINT)
        if self.backward_prefetch is not None and _name_of(self.backward_prefetch) not in ("NO_PREFETCH", "NONE"):
            raise ConfigurationError(f"FullyShardedDataParallelPlugin(backward_prefetch={self.backward_prefetch!r}) is "
                                     "an FSDP1 setting: FSDP2 prefetches the next block's parameters by itself. "
                                     "Remove it. " + _CONVERT_HINT)
        if self.forward_prefetch is not None and _as_bool("forward_prefetch", self.forward_prefetch):
            raise ConfigurationError("FullyShardedDataParallelPlugin(forward_prefetch=True) is an FSDP1 setting that "
                                     "FSDP2 does not implement; remove it (reshard_after_forward=False keeps gathered "
                                     "parameters instead). " + _CONVERT_HINT)

    @staticmethod
    def _reshard(value: Any) -> bool | int:
        if value is None:
            return True
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            return value  # FSDP2: reshard to this smaller world size after forward
        try:
            return _as_bool("reshard_after_forward", value)
        except ConfigurationError:
            name = _name_of(value)
            if name in SHARDING_TO_RESHARD:
                raise ConfigurationError(
                    f"reshard_after_forward={value!r} is an FSDP1 sharding strategy; under FSDP2 use "
                    f"reshard_after_forward={SHARDING_TO_RESHARD[name]}.") from None
            raise

    def _normalise_wrap_policy(self) -> None:
        policy = self.auto_wrap_policy
        if isinstance(policy, str) or (policy is not None and hasattr(policy, "name") and not callable(policy)):
            name = str(getattr(policy, "name", policy)).strip().lower()
            if name not in AUTO_WRAP_POLICIES:
                raise ConfigurationError(f"FullyShardedDataParallelPlugin(auto_wrap_policy={policy!r}): choose one of "
                                         f"{AUTO_WRAP_POLICIES} or pass a callable `policy(module) -> bool`.")
            self.auto_wrap_policy = name
        elif policy is not None and not callable(policy):
            raise ConfigurationError(f"FullyShardedDataParallelPlugin(auto_wrap_policy={policy!r}) must be a policy "
                                     f"name {AUTO_WRAP_POLICIES} or a callable `policy(module) -> bool`.")
        names = self.transformer_cls_names_to_wrap
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",") if n.strip()]
        self.transformer_cls_names_to_wrap = list(names) if names is not None else None
        if self.min_num_params is not None:
            try:
                self.min_num_params = int(float(self.min_num_params))
            except (TypeError, ValueError):
                raise ConfigurationError(f"FullyShardedDataParallelPlugin(min_num_params={self.min_num_params!r}) "
                                         "must be a number of parameters, e.g. 1e8.") from None
            if self.min_num_params < 0:
                raise ConfigurationError(f"min_num_params={self.min_num_params} must be >= 0.")
        if self.auto_wrap_policy is None and self.transformer_cls_names_to_wrap:
            self.auto_wrap_policy = "transformer_based_wrap"
        elif self.auto_wrap_policy is None and self.min_num_params is not None:
            self.auto_wrap_policy = "size_based_wrap"

    # ------------------------------------------------------------------------- Accelerate's methods
    def set_state_dict_type(self, state_dict_type: Any = None) -> None:
        """Choose how checkpoints are written: ``"SHARDED_STATE_DICT"`` (default) or ``"FULL_STATE_DICT"``."""
        name = "SHARDED_STATE_DICT" if state_dict_type is None else _name_of(state_dict_type)
        name = {"1": "FULL_STATE_DICT", "3": "SHARDED_STATE_DICT"}.get(name, name)
        if name not in STATE_DICT_TYPES:
            hint = " (LOCAL_STATE_DICT is FSDP1's)" if name in ("LOCAL_STATE_DICT", "2") else ""
            raise ConfigurationError(f"state_dict_type={state_dict_type!r}{hint}: choose one of {STATE_DICT_TYPES}.")
        self.state_dict_type = name

    def validate_cpu_offload(self) -> None:
        """Turn ``cpu_offload`` into a bool (FSDP1's ``CPUOffload`` and FSDP2's ``CPUOffloadPolicy`` accepted)."""
        value = self.cpu_offload
        if value is None:
            self.cpu_offload = False
        elif hasattr(value, "offload_params"):  # FSDP1's CPUOffload(offload_params=...)
            self.cpu_offload = bool(value.offload_params)
        elif type(value).__name__ == "CPUOffloadPolicy":
            self._extra["offload_policy"] = value
            self.cpu_offload = True
        else:
            self.cpu_offload = _as_bool("cpu_offload", value)

    def set_cpu_offload(self) -> None:
        """Accelerate's name for :meth:`validate_cpu_offload`."""
        self.validate_cpu_offload()

    def set_mixed_precision(self, mixed_precision: str, buffer_autocast: bool = False, override: bool = False) -> None:
        """Set ``mixed_precision_policy`` from ``"no"``/``"fp16"``/``"bf16"`` unless one is set (or ``override``).

        ``buffer_autocast`` chooses FSDP1's buffer dtype in Accelerate (fp32 when True, else the
        compute dtype). FSDP2, the only FSDP here, has no buffer dtype: buffers keep the dtype the
        model gives them (what ``True`` asks for, with an fp32 model), as under Accelerate's FSDP2.

        Raises:
            ConfigurationError: ``buffer_autocast`` or ``override`` is not a bool.
        """
        for name, value in (("buffer_autocast", buffer_autocast), ("override", override)):
            if not isinstance(value, bool):
                raise ConfigurationError(f"set_mixed_precision({name}={value!r}): pass True or False.")
        if self.mixed_precision_policy is None or override:
            self.mixed_precision_policy = None if str(mixed_precision) in ("no", "fp32", "None") else str(mixed_precision)

    def validate_mixed_precision_policy(self) -> None:
        """Turn a dict ``mixed_precision_policy`` (dtype names allowed) into FSDP2's ``MixedPrecisionPolicy``.

        Raises:
            ConfigurationError: unknown policy fields or dtype names.
        """
        if isinstance(self.mixed_precision_policy, Mapping):
            self.mixed_precision_policy = policy_from_fields(self.mixed_precision_policy)

    def set_auto_wrap_policy(self, model: Any) -> UnitPolicy | None:
        """The unit policy ``policy(module, unwrapped_numel) -> bool`` of ``auto_wrap_policy`` for ``model``."""
        return build_wrap_policy(self, model)

    def offload_policy(self) -> Any:
        """The ``CPUOffloadPolicy`` object passed by the user, if any."""
        return self._extra.get("offload_policy")


# ------------------------------------------------------------------------------ mixed precision policy
# Names a config file or a dict may use for FSDP2's dtypes -> the torch dtype's attribute name.
_DTYPE_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
                "half": "float16", "fp32": "float32", "float32": "float32", "float": "float32"}
_POLICY_FIELDS = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")


def policy_dtype(value: Any) -> Any:
    """A ``torch.dtype`` from a dtype or its name (``"bf16"``, ``"bfloat16"``, ``"torch.float16"``...); None stays None.

    Raises:
        ConfigurationError: a name that is not one of the accepted dtypes.
    """
    import torch

    if value is None or isinstance(value, torch.dtype):
        return value
    key = str(value).replace("torch.", "").lower()
    if key not in _DTYPE_NAMES:
        raise ConfigurationError(f"mixed_precision_policy dtype {value!r}: use one of {sorted(_DTYPE_NAMES)} or a "
                                 "torch.dtype.")
    return getattr(torch, _DTYPE_NAMES[key])


def policy_from_fields(fields: Mapping[str, Any]) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` from a mapping of its fields, dtypes given as dtypes or names.

    Raises:
        ConfigurationError: unknown fields or dtype names.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    unknown = set(fields) - set(_POLICY_FIELDS)
    if unknown:
        raise ConfigurationError(f"mixed_precision_policy keys {sorted(unknown)} are not MixedPrecisionPolicy fields "
                                 f"({', '.join(_POLICY_FIELDS)}).")
    return MixedPrecisionPolicy(**{k: (v if k == "cast_forward_inputs" else policy_dtype(v)) for k, v in fields.items()})


# ------------------------------------------------------------------------------ launch configuration
# Launch key -> plugin keyword, from the one table in hasten.config.schema.
_LAUNCH_FIELDS: dict[str, str] = {key.name: key.plugin_field for key in FSDP_KEYS if key.plugin_field is not None}


def _prefixed(block: Mapping[str, Any]) -> dict[str, Any]:
    """Accelerate adds the ``fsdp_`` prefix to keys written without it; so does hasten."""
    out: dict[str, Any] = {}
    for key, value in block.items():
        full = key if str(key).startswith("fsdp_") else f"fsdp_{key}"
        if full not in _LAUNCH_FIELDS:
            raise ConfigurationError(f"Unknown key {key!r} in the fsdp_config block; valid keys: "
                                     f"{sorted(_LAUNCH_FIELDS)}.")
        if full == "fsdp_backward_prefetch_policy":  # Accelerate < 0.20 spelling
            full = "fsdp_backward_prefetch"
        out[full] = value
    return out


def fsdp_plugin_from_launch_config(launch: LaunchConfig | Mapping[str, Any]) -> FullyShardedDataParallelPlugin:
    """Build the plugin from the launch configuration's ``fsdp_config`` block (Accelerate's ``fsdp_*`` keys).

    A block without ``fsdp_version`` is FSDP2 unless it holds FSDP1-only keys (then it is an FSDP1
    file and is refused with the ``hasten to-fsdp2`` hint). With ``fsdp_version: 2``, leftover
    FSDP1 keys whose behaviour FSDP2 has built in (``sync_module_states``, ``use_orig_params``) are
    ignored with a warning; ``sharding_strategy`` and prefetch settings are refused.

    Example:
        >>> fsdp_plugin_from_launch_config({"fsdp_config": {"fsdp_reshard_after_forward": "false"}}).reshard_after_forward
        False

    Raises:
        ConfigurationError: unknown keys, FSDP1 configuration, invalid values.
    """
    block = _prefixed(launch.fsdp_config if isinstance(launch, LaunchConfig) else launch.get("fsdp_config") or {})
    version = block.get("fsdp_version")
    fsdp1_keys = [k for k in FSDP1_ONLY_KEYS if block.get(k) is not None]
    if str(version) == "1" or (version is None and fsdp1_keys):
        raise ConfigurationError(f"The launch configuration's fsdp_config is an FSDP1 configuration (fsdp_version="
                                 f"{version!r}, FSDP1 keys {fsdp1_keys}). " + _CONVERT_HINT)
    kwargs: dict[str, Any] = {}
    for key, value in block.items():
        if key in ("fsdp_sync_module_states", "fsdp_use_orig_params"):
            warnings.warn(f"fsdp_config key {key} is ignored by FSDP2 (its behaviour is built in); "
                          "`hasten to-fsdp2` removes it.", UserWarning, stacklevel=2)
            continue
        kwargs[_LAUNCH_FIELDS[key]] = value
    if kwargs.get("fsdp_version") is not None:
        kwargs["fsdp_version"] = int(str(kwargs["fsdp_version"]))
    return FullyShardedDataParallelPlugin(**kwargs)


def convert_fsdp1_config(block: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Rewrite an FSDP1 ``fsdp_config`` block for FSDP2; returns the new block and what changed.

    Example:
        >>> convert_fsdp1_config({"fsdp_sharding_strategy": "SHARD_GRAD_OP"})[0]
        {'fsdp_reshard_after_forward': False, 'fsdp_version': 2}
    """
    out: dict[str, Any] = {}
    notes: list[str] = []
    for key, value in _prefixed(block).items():
        if key == "fsdp_sharding_strategy":
            name = _SHARDING_NUMBERS.get(str(value), _name_of(value))
            if name not in SHARDING_TO_RESHARD:
                raise ConfigurationError(f"fsdp_sharding_strategy={value!r} is not an FSDP1 sharding strategy "
                                         f"({sorted(SHARDING_TO_RESHARD)}).")
            out["fsdp_reshard_after_forward"] = SHARDING_TO_RESHARD[name]
            notes.append(f"fsdp_sharding_strategy {name} -> fsdp_reshard_after_forward {SHARDING_TO_RESHARD[name]}")
        elif key in FSDP1_ONLY_KEYS:
            notes.append(f"removed {key} (FSDP2 has no such setting)")
        elif key != "fsdp_version":
            out[key] = value
    out["fsdp_version"] = 2
    return out, notes


__all__ = ["AUTO_WRAP_POLICIES", "DEFAULT_MIN_NUM_PARAMS", "FullyShardedDataParallelPlugin", "STATE_DICT_TYPES",
           "convert_fsdp1_config", "fsdp_plugin_from_launch_config", "ignored_module_list"]
