"""DeepSpeed placeholders and the loaded-config holder; nothing here imports ``deepspeed``.

``DummyOptim`` / ``DummyScheduler`` stand for an optimizer / scheduler written in the DeepSpeed JSON
config (``"optimizer"`` / ``"scheduler"`` blocks): pass them to ``accelerator.prepare`` and the engine
builds the real ones. ``HfDeepSpeedConfig`` reads a config from a dict, a JSON file or a base64 string.
"""

from __future__ import annotations

import base64
import binascii
import copy
import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from hasten._lazy import accelerate_path_getattr
from hasten.exceptions import ConfigurationError


class DummyOptim(torch.optim.Optimizer):
    """Placeholder for the optimizer defined in the DeepSpeed config's ``"optimizer"`` block.

    It is a ``torch.optim.Optimizer`` only so that ``prepare`` recognises it; it never steps.
    ``lr`` and ``weight_decay`` fill ``"auto"`` values of the config's optimizer parameters.

    Args:
        params: the model's parameters (or parameter groups).
        lr: learning rate.
        weight_decay: weight decay.
        **kwargs: kept on ``self.kwargs`` (Accelerate's signature).

    Example:
        >>> optimizer = DummyOptim(model.parameters(), lr=3e-4)
        >>> model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    """

    def __init__(self, params: Iterable[Any], lr: float = 0.001, weight_decay: float = 0, **kwargs: Any) -> None:
        self.params = list(params)  # a generator could be read only once; DeepSpeed needs the list
        self.lr = lr
        self.weight_decay = weight_decay
        self.kwargs = kwargs
        super().__init__(self.params, {"lr": lr, "weight_decay": weight_decay})

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        raise ConfigurationError(
            "DummyOptim only stands for the optimizer of a DeepSpeed config: prepare it with "
            "`Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=...))` whose config has an \"optimizer\" "
            "block, or use a real torch optimizer.")


class DummyScheduler:
    """Placeholder for the scheduler of the DeepSpeed config's ``"scheduler"`` block (or a callable).

    After ``prepare`` it stands for the engine's scheduler: the engine steps it at every optimizer step,
    so ``step()`` here does nothing (no double stepping); ``get_last_lr``, ``state_dict`` and the
    other attributes are the engine scheduler's.

    Args:
        optimizer: the ``DummyOptim`` (its ``lr`` is the warm-up's maximum).
        total_num_steps: total training steps (fills ``"auto"`` ``total_num_steps``).
        warmup_num_steps: warm-up steps (fills ``"auto"`` ``warmup_num_steps``).
        lr_scheduler_callable: ``fn(optimizer) -> scheduler`` used instead of the config's block.
        **kwargs: kept on ``self.kwargs``.

    Example:
        >>> scheduler = DummyScheduler(optimizer, total_num_steps=1000, warmup_num_steps=100)
    """

    def __init__(self, optimizer: Any, total_num_steps: int | None = None, warmup_num_steps: int = 0,
                 lr_scheduler_callable: Callable[[Any], Any] | None = None, **kwargs: Any) -> None:
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = warmup_num_steps
        self.lr_scheduler_callable = lr_scheduler_callable
        self.kwargs = kwargs
        self.engine_scheduler: Any = None

    def bind(self, engine_scheduler: Any) -> None:
        """Stand for ``engine_scheduler`` from now on (called by the DeepSpeed strategy)."""
        self.engine_scheduler = engine_scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Nothing: DeepSpeed's engine steps its scheduler inside ``accelerator.backward``."""

    def get_last_lr(self) -> Any:
        return self._engine().get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self._engine().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._engine().load_state_dict(state_dict)

    def _engine(self) -> Any:
        if self.engine_scheduler is None:
            raise ConfigurationError("This DummyScheduler was not prepared yet: pass it to `accelerator.prepare` "
                                     "together with the model and its DummyOptim.")
        return self.engine_scheduler

    def __getattr__(self, name: str) -> Any:
        if name == "engine_scheduler" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._engine(), name)


class HfDeepSpeedConfig:
    """A DeepSpeed config read from a dict, a JSON file path or a base64-encoded JSON string.

    Args:
        config_file_or_dict: the source; a dict is deep-copied (the caller's stays untouched).

    Raises:
        ConfigurationError: a missing file or invalid JSON, with the path and the position of the error.

    Example:
        >>> HfDeepSpeedConfig({"zero_optimization": {"stage": 3}}).is_zero3()
        True
    """

    def __init__(self, config_file_or_dict: Any) -> None:
        self.config: dict[str, Any] = load_deepspeed_config(config_file_or_dict)

    def find_config_node(self, ds_key_long: str) -> tuple[dict[str, Any] | None, str]:
        """The dict holding the last part of the dotted key (None if a parent is missing), and that part."""
        node: Any = self.config
        *parents, key = ds_key_long.split(".")
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
            if node is None:
                return None, key
        return (node if isinstance(node, dict) else None), key

    def set_stage_and_offload(self) -> None:
        """Read the ZeRO stage and whether anything is offloaded into ``_stage`` / ``_offload`` (the query
        methods read the config each time, so this only refreshes those two attributes)."""
        self._stage = int(self.get_value("zero_optimization.stage", -1))
        self._offload = self.stage() in (2, 3) and self.is_offload()

    def del_config_sub_tree(self, ds_key_long: str, must_exist: bool = False) -> None:
        """Delete the section at a dotted key; a missing one raises ``ValueError`` only with ``must_exist``."""
        node, key = self.find_config_node(ds_key_long)
        if node is None or key not in node:
            if must_exist:
                raise ValueError(f"Can't find {ds_key_long} entry in the config: {self.config}")
            return
        del node[key]

    def get_value(self, ds_key_long: str, default: Any = None) -> Any:
        """The value at a dotted key (``"zero_optimization.stage"``), or ``default``."""
        node, key = self.find_config_node(ds_key_long)
        return default if node is None else node.get(key, default)

    def is_true(self, ds_key_long: str) -> bool:
        value = self.get_value(ds_key_long)
        return value is not None and str(value).lower() == "true"

    def is_false(self, ds_key_long: str) -> bool:
        value = self.get_value(ds_key_long)
        return value is not None and str(value).lower() == "false"

    def stage(self) -> int:
        return int(self.get_value("zero_optimization.stage", 0) or 0)

    def is_zero2(self) -> bool:
        return self.stage() == 2

    def is_zero3(self) -> bool:
        return self.stage() == 3

    def is_offload(self) -> bool:
        return any(str(self.get_value(f"zero_optimization.{part}.device", "none")).lower() in ("cpu", "nvme")
                   for part in ("offload_optimizer", "offload_param"))


def load_deepspeed_config(source: Any) -> dict[str, Any]:
    """Read a DeepSpeed config (dict, ``HfDeepSpeedConfig``-like object, JSON path or base64 JSON).

    Raises:
        ConfigurationError: the file does not exist, is not JSON, or does not hold a JSON object.
    """
    if hasattr(source, "config") and isinstance(source.config, Mapping):
        return copy.deepcopy(dict(source.config))
    if isinstance(source, Mapping):
        return copy.deepcopy(dict(source))
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigurationError(f"DeepSpeedPlugin(hf_ds_config={source!r}): pass a dict, a JSON file path or a "
                                 "base64-encoded JSON string.")
    path = Path(source).expanduser()
    if path.is_file():
        text, origin = path.read_text(encoding="utf-8"), f"DeepSpeed config file {path}"
    else:
        decoded = _base64_json(str(source))
        if decoded is None:
            raise ConfigurationError(
                f"DeepSpeed config file {str(source)!r} does not exist. Pass an existing JSON file "
                "(`DeepSpeedPlugin(hf_ds_config=PATH)` or `hasten launch --deepspeed_config_file PATH`) or a dict.")
        text, origin = decoded, "the base64-encoded DeepSpeed config"
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigurationError(f"{origin} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}. "
                                 "Fix the file (DeepSpeed configs are plain JSON: no comments, no trailing "
                                 "commas).") from exc
    if not isinstance(config, dict):
        raise ConfigurationError(f"{origin} must hold a JSON object ({{...}}), not {type(config).__name__}.")
    return config


def _base64_json(text: str) -> str | None:
    if text.strip().endswith(".json") or not text.strip():
        return None
    try:
        decoded = base64.urlsafe_b64decode(text.encode("ascii")).decode("utf-8")
    except (binascii.Error, UnicodeError, ValueError):
        return None
    return decoded if decoded.lstrip().startswith("{") else None


__all__ = ["DummyOptim", "DummyScheduler", "HfDeepSpeedConfig", "load_deepspeed_config"]


# Names Accelerate shows at this module path but hasten defines elsewhere (hasten/_accelerate_paths.py).
__getattr__ = accelerate_path_getattr(__name__, globals())
