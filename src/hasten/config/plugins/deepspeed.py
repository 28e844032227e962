"""``DeepSpeedPlugin`` (Accelerate's fields and defaults) and the ``deepspeed_config`` launch block.

The plugin holds a DeepSpeed JSON config, either given (``hf_ds_config``: dict, file path, base64) or
built from the plugin's fields. ``"auto"`` values are filled when the model is prepared, from the
Accelerator (micro batch size from the prepared data loaders, ``train_batch_size``, accumulation
steps, fp16/bf16 blocks from ``mixed_precision``, clipping). Nothing here reads the environment:
Accelerate fills ``None`` fields from ``ACCELERATE_DEEPSPEED_*`` variables, hasten gets them through
the launch configuration (:func:`deepspeed_plugin_from_launch_config`). ``deepspeed`` is not imported.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hasten.base.deepspeed import HfDeepSpeedConfig
from hasten.base.deepspeed_runtime import set_z3_leaf_modules_by_name, zero3_init_context
from hasten.base.environment import as_bool
from hasten.config.schema import DEEPSPEED_KEYS, LaunchConfig
from hasten.exceptions import ConfigurationError

OFFLOAD_DEVICES = ("none", "cpu", "nvme")
ZERO_STAGES = (0, 1, 2, 3)
#: Plugin field -> dotted key of the DeepSpeed config it sets.
FIELD_TO_CONFIG = {
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
    "zero_stage": "zero_optimization.stage",
    "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
    "offload_param_device": "zero_optimization.offload_param.device",
    "offload_optimizer_nvme_path": "zero_optimization.offload_optimizer.nvme_path",
    "offload_param_nvme_path": "zero_optimization.offload_param.nvme_path",
    "zero3_save_16bit_model": "zero_optimization.stage3_gather_16bit_weights_on_model_save",
}


def _as_bool(name: str, value: Any) -> bool:
    return as_bool(value, name, owner="DeepSpeedPlugin")


def _as_int_or_auto(name: str, value: Any, minimum: int) -> int | str:
    if value == "auto":
        return value
    if isinstance(value, bool) or not str(value).strip().lstrip("-").isdigit() or int(value) < minimum:
        raise ConfigurationError(f"DeepSpeedPlugin({name}={value!r}) must be an integer >= {minimum} or 'auto'.")
    return int(value)


def _check_stage(value: Any, where: str) -> int:
    try:
        stage = int(value)
    except (TypeError, ValueError):
        stage = -1
    if isinstance(value, bool) or stage not in ZERO_STAGES:
        raise ConfigurationError(f"{where}={value!r} is out of range: the ZeRO stage must be 0, 1, 2 or 3 "
                                 "(0 = plain data parallel, 1 = shard optimizer states, 2 = + gradients, "
                                 "3 = + parameters).")
    return stage


def _check_device(name: str, value: Any) -> str:
    device = str(value).strip().lower()
    if device not in OFFLOAD_DEVICES:
        raise ConfigurationError(f"DeepSpeedPlugin({name}={value!r}): choose one of {OFFLOAD_DEVICES}.")
    return device


@dataclass
class DeepSpeedPlugin:
    """Train with DeepSpeed ZeRO (``deepspeed.initialize``) through the ordinary Accelerator loop.

    Field names and defaults are Accelerate's; ``None`` means: 2 for ``zero_stage``, ``"none"`` for
    the offload devices, ``"auto"`` for accumulation and clipping (filled from the Accelerator),
    ``zero3_init_flag`` on for stage 3, ``zero3_save_16bit_model`` off. With ``hf_ds_config`` the
    JSON config rules; fields you also set fill its ``"auto"`` values and must agree with the rest.

    Example:
        >>> plugin = DeepSpeedPlugin(zero_stage=3, offload_optimizer_device="cpu")
        >>> accelerator = Accelerator(deepspeed_plugin=plugin, mixed_precision="bf16")

    Raises:
        ConfigurationError: a missing or invalid config file, a ZeRO stage outside 0-3, an unknown
            offload device, an nvme device without its path, or a field contradicting the config.
    """

    hf_ds_config: Any = None
    gradient_accumulation_steps: Any = None
    gradient_clipping: Any = None
    zero_stage: Any = None
    is_train_batch_min: bool = True
    offload_optimizer_device: Any = None
    offload_param_device: Any = None
    offload_optimizer_nvme_path: Any = None
    offload_param_nvme_path: Any = None
    zero3_init_flag: Any = None
    zero3_save_16bit_model: Any = None
    transformer_moe_cls_names: Any = None
    enable_msamp: Any = None
    msamp_opt_level: Any = None
    deepspeed_config: dict[str, Any] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        if self.enable_msamp:
            raise ConfigurationError("DeepSpeedPlugin(enable_msamp=True): MS-AMP (fp8) is not available in hasten; "
                                     "remove it and use mixed_precision='bf16'.")
        explicit = {name: getattr(self, name) for name in FIELD_TO_CONFIG if getattr(self, name) is not None}
        self._normalise_fields()
        if self.hf_ds_config is None:
            self.hf_ds_config = HfDeepSpeedConfig(self._config_from_fields())
        else:
            self.hf_ds_config = HfDeepSpeedConfig(self.hf_ds_config)
            self._check_given_config(explicit)
        self.deepspeed_config = self.hf_ds_config.config
        self.deepspeed_config.setdefault("steps_per_print", float("inf"))  # no progress lines from the engine
        self._check_offload()
        is_zero3 = self.hf_ds_config.is_zero3()
        if self.zero3_init_flag is None:
            self.zero3_init_flag = is_zero3
        self.zero3_init_flag = _as_bool("zero3_init_flag", self.zero3_init_flag)
        if self.zero3_init_flag and not is_zero3:
            warnings.warn("DeepSpeedPlugin(zero3_init_flag=True) only applies to ZeRO stage 3; it is turned off.",
                          stacklevel=3)
            self.zero3_init_flag = False
        self._selected = True

    def _normalise_fields(self) -> None:
        self.gradient_accumulation_steps = _as_int_or_auto(
            "gradient_accumulation_steps", "auto" if self.gradient_accumulation_steps is None
            else self.gradient_accumulation_steps, 1)
        clip = "auto" if self.gradient_clipping is None else self.gradient_clipping
        if clip != "auto":
            try:
                clip = float(clip)
            except (TypeError, ValueError):
                raise ConfigurationError(f"DeepSpeedPlugin(gradient_clipping={clip!r}) must be a number or 'auto'.") from None
        self.gradient_clipping = clip
        self.zero_stage = _check_stage(2 if self.zero_stage is None else self.zero_stage, "DeepSpeedPlugin(zero_stage")
        for name in ("offload_optimizer_device", "offload_param_device"):
            setattr(self, name, _check_device(name, getattr(self, name) or "none"))
        for name in ("offload_optimizer_nvme_path", "offload_param_nvme_path"):
            setattr(self, name, getattr(self, name) or "none")
        self.zero3_save_16bit_model = _as_bool("zero3_save_16bit_model", self.zero3_save_16bit_model or False)

    def _config_from_fields(self) -> dict[str, Any]:
        def offload(device: str, path: str) -> dict[str, Any]:
            return {"device": device, "nvme_path": path if device == "nvme" else None}

        config: dict[str, Any] = {
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "zero_optimization": {
                "stage": self.zero_stage,
                "offload_optimizer": offload(self.offload_optimizer_device, self.offload_optimizer_nvme_path),
                "offload_param": offload(self.offload_param_device, self.offload_param_nvme_path),
                "stage3_gather_16bit_weights_on_model_save": self.zero3_save_16bit_model,
            },
        }
        if self.gradient_clipping:
            config["gradient_clipping"] = self.gradient_clipping
        return config

    def _check_given_config(self, explicit: Mapping[str, Any]) -> None:
        config = self.deepspeed_config_dict
        if not isinstance(config.get("zero_optimization"), dict):
            raise ConfigurationError("The DeepSpeed config has no \"zero_optimization\" block: add one, e.g. "
                                     "\"zero_optimization\": {\"stage\": 2}.")
        config.setdefault("gradient_accumulation_steps", 1)
        stage = config["zero_optimization"].get("stage", 0)
        if stage != "auto":
            _check_stage(stage, "DeepSpeed config zero_optimization.stage")
        values = {FIELD_TO_CONFIG[name]: getattr(self, name) for name in explicit}
        self.deepspeed_config_process(must_match=True, **values)
        # The fields mirror the config, so reading `plugin.zero_stage` tells the truth.
        self.zero_stage = self.hf_ds_config.stage() if stage != "auto" else self.zero_stage
        self.gradient_accumulation_steps = config["gradient_accumulation_steps"]
        self.gradient_clipping = config.get("gradient_clipping", self.gradient_clipping)
        for name in ("offload_optimizer_device", "offload_param_device"):
            value = self.hf_ds_config.get_value(FIELD_TO_CONFIG[name])
            if value not in (None, "auto"):
                setattr(self, name, _check_device(name, value))

    def _check_offload(self) -> None:
        for part, name in (("offload_optimizer", "offload_optimizer_device"), ("offload_param", "offload_param_device")):
            device = str(self.hf_ds_config.get_value(f"zero_optimization.{part}.device", "none")).lower()
            if device == "nvme" and self.hf_ds_config.get_value(f"zero_optimization.{part}.nvme_path") in (None, "none"):
                raise ConfigurationError(f"{name}='nvme' needs a folder: set `{name.replace('device', 'nvme_path')}` "
                                         f"(or zero_optimization.{part}.nvme_path in the config).")
        param_device = str(self.hf_ds_config.get_value("zero_optimization.offload_param.device", "none")).lower()
        stage = self.hf_ds_config.get_value("zero_optimization.stage", 0)
        if param_device != "none" and stage != "auto" and int(stage) != 3:
            raise ConfigurationError(f"offload_param_device={param_device!r} needs ZeRO stage 3 (got stage {stage}): "
                                     "parameters are only partitioned, hence offloadable, at stage 3. Set zero_stage=3 "
                                     "or offload only the optimizer (offload_optimizer_device).")

    # ----------------------------------------------------------------------------- config access
    @property
    def deepspeed_config_dict(self) -> dict[str, Any]:
        return self.hf_ds_config.config

    def get_value(self, ds_key_long: str, default: Any = None) -> Any:
        """The config value at a dotted key, e.g. ``"zero_optimization.stage"``."""
        return self.hf_ds_config.get_value(ds_key_long, default)

    def set_deepspeed_weakref(self) -> None:
        """Let 🤗 Transformers see this ZeRO-3 config (``from_pretrained`` then builds the model sharded).

        Transformers reads it through a global weak reference to an ``HfDeepSpeedConfig`` of its own; the
        plugin keeps that object alive. Without transformers installed there is nothing to do.
        """
        try:
            from transformers.integrations import HfDeepSpeedConfig as TransformersDeepSpeedConfig
        except ImportError:
            return
        config = {k: v for k, v in self.deepspeed_config.items()}
        for key in ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps"):
            if config.get(key) == "auto":
                config[key] = 1  # transformers only needs the ZeRO block; "auto" batch keys would be refused
        self._transformers_ds_config = TransformersDeepSpeedConfig(config)

    def is_auto(self, ds_key_long: str) -> bool:
        """True when the config value at ``ds_key_long`` is ``"auto"``."""
        return self.get_value(ds_key_long) == "auto"

    def fill_match(self, ds_key_long: str, mismatches: list[str] | None = None, must_match: bool = True,
                   **kwargs: Any) -> None:
        """Replace an ``"auto"`` value by ``kwargs[ds_key_long]``; with ``must_match``, record a differing value.

        Raises:
            ConfigurationError: a mismatch when no ``mismatches`` list is given to collect it.
        """
        node, key = self.hf_ds_config.find_config_node(ds_key_long)
        if node is None or ds_key_long not in kwargs:
            return
        given = kwargs[ds_key_long]
        if node.get(key) == "auto":
            node[key] = given
            return
        if must_match and key in node and given != "auto" and not _same(node[key], given):
            line = f"- ds {ds_key_long}={node[key]!r} vs hasten {given!r}"
            if mismatches is None:
                raise ConfigurationError(f"The DeepSpeed config contradicts the plugin/launch settings:\n{line}\n"
                                         "Change one of them, or write \"auto\" in the config.")
            mismatches.append(line)

    def deepspeed_config_process(self, prefix: str = "", mismatches: list[str] | None = None, config: Any = None,
                                 must_match: bool = True, **kwargs: Any) -> None:
        """Fill every ``"auto"`` entry found in ``kwargs`` (dotted keys), checking the others agree.

        Raises:
            ConfigurationError: listing every value that contradicts ``kwargs`` (with ``must_match``).
        """
        top = mismatches is None
        mismatches = [] if mismatches is None else mismatches
        config = self.deepspeed_config_dict if config is None else config
        for key, value in list(config.items()):
            if isinstance(value, dict):
                self.deepspeed_config_process(prefix + key + ".", mismatches, value, must_match, **kwargs)
            else:
                self.fill_match(prefix + key, mismatches, must_match=must_match, **kwargs)
        if top and mismatches:
            raise ConfigurationError("Please correct these DeepSpeed config values that contradict the "
                                     "plugin/launch settings (or write \"auto\" in the config):\n" + "\n".join(mismatches))

    def set_mixed_precision(self, mixed_precision: str) -> None:
        """Write the fp16/bf16 blocks for ``mixed_precision`` ("no", "fp16", "bf16").

        Raises:
            ConfigurationError: the config enables the other 16-bit type.
        """
        config = self.deepspeed_config_dict
        mixed_precision = str(mixed_precision or "no").lower()
        if mixed_precision == "fp8":
            raise ConfigurationError("mixed_precision='fp8' with DeepSpeed is not available in hasten; use 'bf16'.")
        if mixed_precision in ("fp16", "bf16"):
            other = "bf16" if mixed_precision == "fp16" else "fp16"
            if str(config.get(other, {}).get("enabled", False)).lower() == "true":
                raise ConfigurationError(f"mixed_precision={mixed_precision!r} contradicts the DeepSpeed config, which "
                                         f"enables {other}. Use the same precision in both places.")
            config.setdefault(mixed_precision, {"enabled": True, "auto_cast": True} if mixed_precision == "fp16"
                              else {"enabled": True})
        for dtype in ("fp16", "bf16"):
            config.setdefault(dtype, {"enabled": False})
        wanted: dict[str, Any] = {"fp16.enabled": mixed_precision == "fp16", "bf16.enabled": mixed_precision == "bf16"}
        self.fill_match("fp16.enabled", must_match=False, **wanted)
        self.fill_match("bf16.enabled", must_match=False, **wanted)

    def engine_mixed_precision(self) -> str:
        """"fp16", "bf16" or "no", as the config's blocks say (what the engine will really do)."""
        for dtype in ("fp16", "bf16"):
            if str(self.get_value(f"{dtype}.enabled", False)).lower() == "true":
                return dtype
        return "no"

    # ------------------------------------------------------------------------------ ZeRO-3 helpers
    def is_zero3_init_enabled(self) -> bool:
        """True when models should be created partitioned (stage 3 with ``zero3_init_flag``)."""
        return bool(self.zero3_init_flag)

    def zero3_init_context_manager(self, enable: bool = False) -> Any:
        """``deepspeed.zero.Init`` for this config when ``enable`` (imports deepspeed), else a null context."""
        return zero3_init_context(self.deepspeed_config, enable)

    def set_moe_leaf_modules(self, model: Any) -> None:
        """Mark ``transformer_moe_cls_names`` modules as ZeRO-3 leaves (imports deepspeed when set)."""
        if not self.transformer_moe_cls_names:
            return
        set_z3_leaf_modules_by_name(model, str(self.transformer_moe_cls_names).split(","))

    def select(self, _from_accelerator_state: bool = False) -> None:
        """Make this plugin the active one (hasten keeps one active DeepSpeed plugin)."""
        self._selected = True

    @property
    def selected(self) -> bool:
        return getattr(self, "_selected", False)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return str(a).lower() == str(b).lower()
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return str(a).lower() == str(b).lower()


#: ``deepspeed_config`` block keys that select machines, which the single-launcher hasten ignores.
_NONE_MEANS_UNSET = ("hf_ds_config", "transformer_moe_cls_names")
# Launch key -> plugin keyword, from the one table in hasten.config.schema (None: read by the launcher).
_LAUNCH_FIELDS: dict[str, str | None] = {key.name: key.plugin_field for key in DEEPSPEED_KEYS}


def deepspeed_plugin_from_launch_config(launch: LaunchConfig | Mapping[str, Any]) -> DeepSpeedPlugin:
    """Build the plugin from the launch configuration's ``deepspeed_config`` block (Accelerate's keys).

    Example:
        >>> deepspeed_plugin_from_launch_config({"distributed_type": "DEEPSPEED",
        ...                                      "deepspeed_config": {"zero_stage": 3}}).zero_stage
        3

    Raises:
        ConfigurationError: unknown keys, or invalid values (see :class:`DeepSpeedPlugin`).
    """
    block = dict(launch.deepspeed_config if isinstance(launch, LaunchConfig) else launch.get("deepspeed_config") or {})
    unknown = sorted(set(block) - set(_LAUNCH_FIELDS))
    if unknown:
        raise ConfigurationError(f"Unknown keys in the deepspeed_config block: {unknown}. Known keys: "
                                 f"{sorted(_LAUNCH_FIELDS)}.")
    kwargs: dict[str, Any] = {}
    for key, value in block.items():
        target = _LAUNCH_FIELDS[key]
        # "none" is how Accelerate's questionnaire writes "no file" / "no MoE layers".
        if target is None or value is None or (target in _NONE_MEANS_UNSET and value in ("", "none")):
            continue
        # With a config file, Accelerate ignores the other keys; hasten accepts only those agreeing with it.
        kwargs[target] = value
    return DeepSpeedPlugin(**kwargs)


__all__ = ["DeepSpeedPlugin", "deepspeed_plugin_from_launch_config"]


def get_active_deepspeed_plugin(state: Any) -> Any:
    """The active ``DeepSpeedPlugin`` of ``state`` (an ``AcceleratorState``).

    Raises:
        ValueError: the run is not a DeepSpeed run (Accelerate's message).
    """
    if str(getattr(state, "distributed_type", "")) != "DEEPSPEED":
        raise ValueError("Couldn't retrieve the active `DeepSpeedPlugin` as none were enabled. Please make sure that "
                         "either `Accelerator` is configured for `deepspeed` or make sure that the desired "
                         "`DeepSpeedPlugin` has been enabled (`AcceleratorState().select_deepspeed_plugin(name)`) "
                         "before calling this function.")
    return state.deepspeed_plugin


def map_pytorch_optim_to_deepspeed(optimizer: Any) -> Any:
    """DeepSpeed's CPU optimizer for a torch optimizer's parameter groups (for ZeRO optimizer offload):
    ``DeepSpeedCPUAdagrad`` for ``Adagrad``, else ``DeepSpeedCPUAdam`` (in AdamW mode for ``AdamW``), with
    the optimizer's ``lr`` and ``weight_decay``. Needs deepspeed."""
    import torch

    from hasten.base.deepspeed_runtime import import_deepspeed

    import_deepspeed()
    defaults = {k: v for k, v in optimizer.defaults.items() if k in ("lr", "weight_decay")}
    if isinstance(optimizer, torch.optim.Adagrad):
        from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad

        return DeepSpeedCPUAdagrad(optimizer.param_groups, **defaults)
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(optimizer.param_groups, adamw_mode=isinstance(optimizer, torch.optim.AdamW), **defaults)
