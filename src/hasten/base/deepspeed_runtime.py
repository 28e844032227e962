"""The one place hasten imports ``deepspeed``, and the ZeRO-3 helpers the plugin and the strategy share.

Below both ``config.plugins.deepspeed`` (whose Accelerate-compatible methods call the helpers) and
``strategies.deepspeed`` (which builds the engine), so neither imports the other's layer upward.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch

from hasten.exceptions import ConfigurationError, MissingDependencyError


def import_deepspeed(device_type: str = "cpu") -> Any:
    """Import ``deepspeed`` with the accelerator matching hasten's device.

    DeepSpeed picks its accelerator once, at import, from ``DS_ACCELERATOR`` or by probing for GPUs;
    on a CPU run (including ``cpu=True`` on a GPU machine) it must use its "cpu" accelerator, or it
    would place the engine on a GPU and talk NCCL to a gloo group. Setting the variable for this
    third-party library is the one environment write hasten allows itself here.

    Raises:
        MissingDependencyError: deepspeed is not installed.
    """
    if device_type == "cpu" and "deepspeed" not in sys.modules:
        os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        import deepspeed
    except ImportError as exc:
        raise MissingDependencyError("deepspeed", "DeepSpeed training (DeepSpeedPlugin)", extra="deepspeed") from exc
    from deepspeed.accelerator import get_accelerator, set_accelerator

    if device_type == "cpu" and get_accelerator().device_name() != "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        set_accelerator(CPU_Accelerator())  # deepspeed was imported earlier for a GPU
    return deepspeed


def zero3_init_context(config: Any, enable: bool = False) -> Any:
    """``deepspeed.zero.Init`` for ``config`` (models are created partitioned), or a null context.

    Args:
        config: the DeepSpeed config dict (or an object with a ``deepspeed_config`` dict, e.g. the plugin).
        enable: False gives a null context without importing deepspeed.
    """
    if not enable:
        return nullcontext()
    config = getattr(config, "deepspeed_config", config)
    deepspeed = import_deepspeed("cpu" if not torch.cuda.is_available() else "cuda")
    return deepspeed.zero.Init(config_dict_or_path=config)


def set_z3_leaf_modules_by_name(model: Any, class_names: Sequence[str]) -> None:
    """Mark the modules whose class name is in ``class_names`` as ZeRO-3 leaf modules (MoE layers)."""
    from deepspeed.utils import set_z3_leaf_modules

    wanted = {name.strip() for name in class_names if name.strip()}
    classes = list({type(m) for m in model.modules() if type(m).__name__ in wanted})
    missing = wanted - {c.__name__ for c in classes}
    if missing:
        raise ConfigurationError(f"transformer_moe_cls_names names classes not found in the model: {sorted(missing)}.")
    set_z3_leaf_modules(model, classes)


__all__ = ["import_deepspeed", "set_z3_leaf_modules_by_name", "zero3_init_context"]
