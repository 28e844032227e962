"""Saving a transformers model cut into pipeline stages: ``save_pretrained`` on a cut model (and on a PEFT
wrapper around one) writes the whole model or refuses, never one stage as if it were the whole model.

Used by :func:`hasten.strategies.pipeline_hf.cut_transformers_stages` on the model it cuts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hasten.exceptions import ConfigurationError


def to_meta(unit: nn.Module) -> nn.Module:
    """``unit`` (just cut away from this stage) with its weights replaced by shapeless meta tensors, in place.

    The Parameter objects are replaced in ``unit``'s own tables, not changed: one this stage shares (a tied
    weight) stays whole where the stage holds it, and the others are freed with the optimizer's reference.
    """
    for module in unit.modules():
        for key, param in module._parameters.items():
            if param is not None:
                module._parameters[key] = nn.Parameter(torch.empty_like(param, device="meta"), param.requires_grad)
        for key, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[key] = torch.empty_like(buffer, device="meta")
    return unit


def save_adapters_of_every_stage(model: nn.Module, skeletons: dict[str, nn.Module]) -> None:
    """A PEFT wrapper's ``save_pretrained(path, state_dict=full)`` writes every stage's adapter weights.

    PEFT picks the adapter's entries of ``state_dict`` by visiting the adapter layers of the model it is
    called on, which on a cut stage are that stage's only; for the call the other stages' units come back
    as meta-tensor skeletons (their names, no weights), and the values are the given state dict's.
    """
    save_pretrained: Any = model.save_pretrained

    def save_with_every_stage(*args: Any, state_dict: Any = None, **kwargs: Any) -> Any:
        if state_dict is None:
            return save_pretrained(*args, **kwargs)
        skipped = {name: model.get_submodule(name) for name in skeletons}
        try:
            for name, unit in skeletons.items():
                parent, _, child = name.rpartition(".")
                model.get_submodule(parent).register_module(child, unit)
            return save_pretrained(*args, state_dict=state_dict, **kwargs)
        finally:
            for name, unit in skipped.items():
                parent, _, child = name.rpartition(".")
                model.get_submodule(parent).register_module(child, unit)

    model.save_pretrained = save_with_every_stage  # type: ignore[assignment]




def guard_save_pretrained(model: nn.Module, full_weights: Callable[[], dict[str, torch.Tensor] | None]) -> None:
    """The cut model's ``save_pretrained`` without a ``state_dict`` would write one stage as the whole
    model: on the main process of unsharded stages it saves ``full_weights()`` (the other stages' weights
    read from their state servers: :mod:`hasten.strategies.pipeline_state_service`); elsewhere it refuses,
    since the caller may be that process alone and a gather the other stages do not join would hang. With
    a ``state_dict`` (``accelerator.get_state_dict``) it saves as usual.
    """
    save_pretrained = getattr(model, "save_pretrained", None)
    if save_pretrained is None:
        return

    def guarded(*args: Any, state_dict: Any = None, **kwargs: Any) -> Any:
        if state_dict is None:
            state_dict = full_weights()
        if state_dict is None:
            raise ConfigurationError(
                "Under pp_size > 1 this model object holds one pipeline stage; save_pretrained would write that stage "
                "alone. Pass the full weights: model.save_pretrained(path, state_dict=accelerator.get_state_dict("
                "model)) on every process (it gathers), or accelerator.save_model(model, path). Without state_dict, "
                "save_pretrained reads the other stages' weights only on the main process and only when the stages "
                "are not sharded (no dp_shard_size/tp_size): Transformers' Trainer checkpoints (save_strategy, "
                "trainer.save_model()) with sharded stages are not available yet; there set save_strategy='no' and "
                "save the trained model with trainer.accelerator.save_model(trainer.model_wrapped, path) on every "
                "process.")
        return save_pretrained(*args, state_dict=state_dict, **kwargs)

    model.save_pretrained = guarded  # type: ignore[assignment]


__all__ = ["guard_save_pretrained", "save_adapters_of_every_stage", "to_meta"]
