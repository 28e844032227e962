"""Accelerate's ``accelerate.utils.fsdp_utils``: the FSDP2 helpers under Accelerate's module path.

A facade: each name resolves on first use from the part of hasten that owns it (checkpoint files from
``hasten.checkpointing``, sharding helpers from ``hasten.base.fsdp2``...). The two helpers defined here
are small, torch-only functions TRL and Accelerate's own FSDP2 preparation use.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from torch import nn

from hasten._lazy import lazy_getattr

_EXPORTS = {
    "save_fsdp_model": "hasten.checkpointing.fsdp_files",
    "load_fsdp_model": "hasten.checkpointing.fsdp_files",
    "save_fsdp_optimizer": "hasten.checkpointing.fsdp_files",
    "load_fsdp_optimizer": "hasten.checkpointing.fsdp_files",
    "merge_fsdp_weights": "hasten.checkpointing.dcp",
    "enable_fsdp_ram_efficient_loading": "hasten.base.environment",
    "disable_fsdp_ram_efficient_loading": "hasten.base.environment",
    "ensure_weights_retied": "hasten.big_modeling",
    "fsdp2_load_full_state_dict": "hasten.base.fsdp2",
    "fsdp2_switch_optimizer_parameters": "hasten.base.fsdp2",
    "fsdp2_apply_ac": "hasten.base.fsdp2",
    "fsdp2_prepare_model": "hasten.base.fsdp2",
    "fsdp2_canonicalize_names": "hasten.base.fsdp2",
    "get_fsdp2_grad_scaler": "hasten.base.modeling",
}

if TYPE_CHECKING:
    from hasten.base.environment import (
        disable_fsdp_ram_efficient_loading as disable_fsdp_ram_efficient_loading,
        enable_fsdp_ram_efficient_loading as enable_fsdp_ram_efficient_loading,
    )
    from hasten.base.fsdp2 import (
        fsdp2_apply_ac as fsdp2_apply_ac,
        fsdp2_canonicalize_names as fsdp2_canonicalize_names,
        fsdp2_load_full_state_dict as fsdp2_load_full_state_dict,
        fsdp2_prepare_model as fsdp2_prepare_model,
        fsdp2_switch_optimizer_parameters as fsdp2_switch_optimizer_parameters,
    )
    from hasten.base.modeling import get_fsdp2_grad_scaler as get_fsdp2_grad_scaler
    from hasten.big_modeling import ensure_weights_retied as ensure_weights_retied
    from hasten.checkpointing.dcp import merge_fsdp_weights as merge_fsdp_weights
    from hasten.checkpointing.fsdp_files import (
        load_fsdp_model as load_fsdp_model,
        load_fsdp_optimizer as load_fsdp_optimizer,
        save_fsdp_model as save_fsdp_model,
        save_fsdp_optimizer as save_fsdp_optimizer,
    )


def get_parameters_from_modules(modules: Iterable[nn.Module] | str | None, model: nn.Module,
                                device: Any) -> set[nn.Parameter]:
    """The parameters of ``modules``: modules, or a regular expression matched against ``model``'s module names
    (matched modules are moved to ``device`` first, as Accelerate does).

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        >>> len(get_parameters_from_modules("1", model, "cpu"))
        2
    """
    if modules is None:
        return set()
    if isinstance(modules, str):
        pattern = re.compile(modules)
        matched = []
        for name, module in model.named_modules():
            if pattern.fullmatch(name):
                module.to(device)
                matched.append(module)
        modules = matched
    return {parameter for module in modules for parameter in module.parameters()}


def fsdp2_prepare_auto_wrap_policy(fsdp2_plugin: Any, model: nn.Module) -> Callable[[nn.Module], bool] | None:
    """``plugin.auto_wrap_policy`` as a predicate on modules (None: no module but the root is sharded).

    Example:
        >>> policy = fsdp2_prepare_auto_wrap_policy(plugin, model)  # doctest: +SKIP
    """
    from hasten.config.plugins.fsdp_units import build_wrap_policy

    policy = build_wrap_policy(fsdp2_plugin, model)
    if policy is None:
        return None
    found = policy

    def predicate(module: nn.Module) -> bool:
        module = getattr(module, "_checkpoint_wrapped_module", module)
        return bool(found(module, sum(p.numel() for p in module.parameters())))

    return predicate


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))
