"""Checkpoints of a pipeline-parallel run in the single-process format, under the full model's names.

Each stage holds some of the model's parameters (under their full names) and an optimizer over them.
A save gathers the stages' weights and optimizer states over the ``pp`` group and the writing process
stores them as one process would: ``model.safetensors`` with every key, and ``optimizer.bin`` indexed
over the full model's parameters in the order of the optimizer the user built before ``prepare``. So a
checkpoint saved with ``pp_size=2`` loads on one process, under DDP, or on another ``pp_size``: each
stage takes its own keys and re-indexes the optimizer state onto its parameters.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hasten.exceptions import CheckpointError
from hasten.strategies.pipeline_nd import full_value

#: Per optimizer: per parameter group, the full model's names of its parameters (before the cut).
OptimizerLayout = list[list[str]]


def optimizer_layout(model: nn.Module, optimizer: torch.optim.Optimizer) -> OptimizerLayout:
    """The names of ``optimizer``'s parameters in ``model``, group by group (recorded before the cut).

    Raises:
        CheckpointError: a parameter that is not the model's (its state could not be named).
    """
    names = {id(param): name for name, param in model.named_parameters()}
    layout = []
    for group in optimizer.param_groups:
        missing = [tuple(p.shape) for p in group["params"] if id(p) not in names]
        if missing:
            raise CheckpointError(f"The optimizer holds parameters of shapes {missing[:4]} that are not the prepared "
                                  "model's: under pp_size > 1 an optimizer must be over the model's parameters.")
        layout.append([names[id(p)] for p in group["params"]])
    return layout


def full_weights(stage: nn.Module, group: Any) -> dict[str, torch.Tensor]:
    """Every stage's weights, merged, on every process of ``group`` (a collective)."""
    mine = {key: full_value(value.detach()).cpu() for key, value in stage.state_dict().items()}  # sharded: gathered
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, mine, group=group)
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part)
    return merged


def full_optimizer_state(stage: nn.Module, optimizer: torch.optim.Optimizer, layout: OptimizerLayout,
                         group: Any) -> dict[str, Any]:
    """The optimizer state one process would have saved for the full model (a collective over ``group``)."""
    names = {id(param): name for name, param in stage.named_parameters()}
    order = [names[id(p)] for p in chain.from_iterable(g["params"] for g in optimizer.param_groups)]
    local = optimizer.state_dict()
    mine = {order[index]: _to_cpu(state) for index, state in local["state"].items()}
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, mine, group=group)
    index_of = {name: index for index, name in enumerate(chain.from_iterable(layout))}
    state = {index_of[name]: value for part in parts for name, value in part.items()}
    groups = [{**{k: v for k, v in hyper.items() if k != "params"}, "params": [index_of[n] for n in names_in_group]}
              for hyper, names_in_group in zip(local["param_groups"], layout)]
    return {"state": state, "param_groups": groups}


def stage_optimizer_state(full: dict[str, Any], stage: nn.Module, optimizer: torch.optim.Optimizer,
                          layout: OptimizerLayout) -> dict[str, Any]:
    """``full`` (the single-process format) re-indexed onto this stage's optimizer.

    Raises:
        CheckpointError: the saved optimizer has other parameter groups than this one.
    """
    saved_groups = full.get("param_groups", [])
    if len(saved_groups) != len(optimizer.param_groups) or [len(g["params"]) for g in saved_groups] != [
            len(names) for names in layout]:
        raise CheckpointError(f"The saved optimizer has groups of {[len(g['params']) for g in saved_groups]} "
                              f"parameters; this one was built with {[len(n) for n in layout]}.")
    names = {id(param): name for name, param in stage.named_parameters()}
    index_of = {name: index for index, name in enumerate(chain.from_iterable(layout))}
    state, groups, position = {}, [], 0
    for saved, current in zip(saved_groups, optimizer.param_groups):
        indices = []
        for param in current["params"]:
            saved_index = index_of[names[id(param)]]
            if saved_index in full.get("state", {}):
                state[position] = full["state"][saved_index]
            indices.append(position)
            position += 1
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": indices})
    return {"state": state, "param_groups": groups}


def _to_cpu(state: dict[str, Any]) -> dict[str, Any]:
    return {key: value.detach().cpu() if isinstance(value, torch.Tensor) else value for key, value in state.items()}


__all__ = ["OptimizerLayout", "full_optimizer_state", "full_weights", "optimizer_layout", "stage_optimizer_state"]
