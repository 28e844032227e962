"""Accelerate's FSDP2 helper functions (``fsdp2_prepare_model`` and friends), over torch's own APIs.

hasten's Accelerator does all of this inside ``prepare``; these exist for scripts that call them
directly.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from hasten import _private_api as private_api
from hasten.exceptions import ConfigurationError

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def fsdp2_prepare_model(accelerator: Any, model: nn.Module) -> nn.Module:
    """Shard ``model`` with FSDP2 as ``accelerator.prepare`` would (the Accelerator needs an FSDP plugin)."""
    if getattr(accelerator.state, "fsdp_plugin", None) is None:
        raise ConfigurationError("fsdp2_prepare_model needs an Accelerator with FSDP2: pass "
                                 "`fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2)`.")
    return accelerator.prepare_model(model)


def fsdp2_load_full_state_dict(accelerator: Any, model: nn.Module, full_sd: dict[str, Any],
                               cpu_offload: bool = False) -> None:
    """Load a full (unsharded) state dict that rank 0 holds into an FSDP2-sharded model, broadcasting it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, cpu_offload=cpu_offload)
    set_model_state_dict(model, full_sd, options=options)


def fsdp2_switch_optimizer_parameters(optimizer: torch.optim.Optimizer, mapping: dict[int, Any]) -> None:
    """Point ``optimizer`` at new parameter objects; ``mapping`` maps each old parameter's ``data_ptr()``
    to its replacement (after sharding replaced the parameters)."""
    for group in optimizer.param_groups:
        try:
            group["params"] = [mapping[p.data_ptr()] for p in group["params"]]
        except KeyError as error:
            raise ConfigurationError("fsdp2_switch_optimizer_parameters: a parameter of the optimizer is not in "
                                     "the mapping; create the optimizer from the model being sharded.") from error


def fsdp2_canonicalize_names(named_params: dict[str, Any]) -> dict[str, Any]:
    """Parameter names without the wrapper prefixes that activation checkpointing and compile add."""
    out = {}
    for name, value in named_params.items():
        for prefix in _WRAPPER_PREFIXES:
            name = name.replace(prefix, "")
        out[name] = value
    return out


def fsdp2_apply_ac(accelerator: Any, model: nn.Module) -> nn.Module:
    """Wrap the model's transformer blocks in activation checkpointing (torch's ``checkpoint_wrapper``).

    The blocks are the plugin's ``transformer_cls_names_to_wrap``, else the model's ``_no_split_modules``.
    """
    apply_activation_checkpointing = private_api.apply_activation_checkpointing()
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    names: Iterable[str] = getattr(plugin, "transformer_cls_names_to_wrap", None) or \
        getattr(model, "_no_split_modules", None) or ()
    names = set(names)
    if not names:
        raise ConfigurationError("fsdp2_apply_ac: no block classes to checkpoint; set "
                                 "`transformer_cls_names_to_wrap` on the FSDP plugin.")
    apply_activation_checkpointing(model, check_fn=lambda m: type(m).__name__ in names)
    return model
