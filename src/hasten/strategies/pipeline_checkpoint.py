"""Checkpoints of a pipeline-parallel run, under the full model's names, in one of two formats.

Each stage holds some of the model's parameters (under their full names) and an optimizer over them.

* **Unsharded stages** (pure PP, PP x DDP): the single-process format. A save gathers the stages' weights
  and optimizer states over the ``pp`` group and the writing process stores them as one process would:
  ``model.safetensors`` with every key, and ``optimizer.bin`` indexed over the full model's parameters in
  the order of the optimizer the user built before ``prepare``. It loads on one process, under DDP, or on
  another ``pp_size``: each stage takes its own keys and re-indexes the optimizer state onto its parameters.
* **Sharded stages** (PP x FSDP2): one ``torch.distributed.checkpoint`` (DCP) checkpoint, the layout of
  hasten's FSDP2 ``SHARDED_STATE_DICT``: ``pytorch_model_fsdp_0/`` holds ``model.<full name>`` and
  ``optimizer_0/`` holds ``optimizer.state.<full name>.<state>`` and ``optimizer.param_groups.<i>.*`` with
  the full model's names in each group's ``params``. Every process writes its own shards (each stage its
  own keys, nothing gathered); identical items (replicas, the groups' hyper-parameters) are written once.
  It loads on any ``pp_size`` (sharded or not), on a run without pipeline parallelism that shards with
  FSDP2 (any process count: DCP reshards), and ``hasten merge-weights`` turns it into one file.
"""

from __future__ import annotations

from itertools import chain
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from hasten.checkpointing import dcp as sharded
from hasten.checkpointing.sinks import Sink
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


def checked_layout(layout: OptimizerLayout | str | None) -> OptimizerLayout:
    """An optimizer's layout as ``prepare`` recorded it.

    Raises:
        CheckpointError: why its state cannot be named (``layout`` is that reason, or ``None``: the optimizer
            was not prepared with the model).
    """
    if isinstance(layout, str):
        raise CheckpointError(layout)
    if layout is None:
        raise CheckpointError("This optimizer was not prepared together with the model under pp_size > 1 "
                              "(prepare(model, optimizer) in one call), so its state cannot be named.")
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
    mine = named_optimizer_state(stage, optimizer)
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, mine, group=group)
    return merged_optimizer_state(parts, optimizer.state_dict()["param_groups"], layout)


def named_optimizer_state(stage: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    """This stage's per-parameter optimizer state keyed by full-model parameter names (CPU copies)."""
    names = {id(param): name for name, param in stage.named_parameters()}
    order = [names[id(p)] for p in chain.from_iterable(g["params"] for g in optimizer.param_groups)]
    return {order[index]: _to_cpu(state) for index, state in optimizer.state_dict()["state"].items()}


def merged_optimizer_state(parts: list[dict[str, dict[str, Any]]], param_groups: list[dict[str, Any]],
                           layout: OptimizerLayout) -> dict[str, Any]:
    """The stages' :func:`named_optimizer_state` as one process's ``optimizer.state_dict()`` of the full
    model: indexed over ``layout`` (the optimizer as built before the cut), groups' hyper-parameters from
    ``param_groups`` (any stage's: they are the same on every stage)."""
    index_of = {name: index for index, name in enumerate(chain.from_iterable(layout))}
    by_index = {index_of[name]: value for part in parts for name, value in part.items()}
    state = {index: by_index[index] for index in sorted(by_index)}
    groups = [{**{k: v for k, v in hyper.items() if k != "params"}, "params": [index_of[n] for n in names_in_group]}
              for hyper, names_in_group in zip(param_groups, layout)]
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


def optimizer_state_for_stage(state: dict[str, Any], stage: nn.Module, optimizer: torch.optim.Optimizer,
                              layout: Any, *, sharded: bool) -> dict[str, Any]:
    """``state`` for the stage's ``optimizer.load_state_dict``: a state saved over the full model (its groups
    as long as ``layout``'s, not the stage's) re-indexed onto the stage's parameters; any other unchanged.

    Raises:
        CheckpointError: a full-model state given to sharded stages, which take it through
            ``accelerator.load_state`` only.
    """
    saved_sizes = [len(group.get("params", ())) for group in state.get("param_groups", [])]
    if (not isinstance(layout, list) or saved_sizes != [len(names) for names in layout]
            or saved_sizes == [len(group["params"]) for group in optimizer.param_groups]):
        return state
    if sharded:
        raise CheckpointError("This optimizer state is the full model's (saved without pipeline parallelism); "
                              "sharded pipeline stages (dp_shard_size/tp_size) load it through accelerator.load_state "
                              "only, not optimizer.load_state_dict.")
    return stage_optimizer_state(state, stage, optimizer, layout)


def named_stage_optimizer_state(state: dict[str, Any], stage: nn.Module,
                                optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A stage's optimizer state as :func:`stage_optimizer_state` returns it (indexed) keyed by parameter names,
    the form ``set_optimizer_state_dict`` takes (to load full tensors into a sharded stage)."""
    names = {id(param): name for name, param in stage.named_parameters()}
    order = [names[id(p)] for p in chain.from_iterable(g["params"] for g in optimizer.param_groups)]
    groups = [{**group, "params": [order[index] for index in group["params"]]} for group in state["param_groups"]]
    return {"state": {order[index]: value for index, value in state["state"].items()}, "param_groups": groups}


# ---------------------------------------------------------------------- sharded stages: one DCP checkpoint
def _named_state(stage: nn.Module, optimizer: torch.optim.Optimizer,
                 layout: OptimizerLayout) -> tuple[dict[str, Any], list[list[str]]]:
    """This stage's optimizer state keyed by names (states created if the optimizer has not stepped), with
    each group's ``params`` the full model's names; and the stage's own names per group."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state: dict[str, Any]
    if _holds_parameters(stage):
        state = cast(dict[str, Any], get_optimizer_state_dict(stage, optimizer))
    else:  # a stage of parameter-free modules (torch's helper refuses an empty state): the groups alone
        state = {"state": {}, "param_groups": [{**group, "params": []} for group in optimizer.param_groups]}
    own = [list(group["params"]) for group in state["param_groups"]]
    state["param_groups"] = [{**group, "params": list(names)} for group, names in zip(state["param_groups"], layout)]
    return state, own


def save_sharded(stage: nn.Module, optimizers: list[torch.optim.Optimizer], layouts: list[OptimizerLayout],
                 folder: Path, sink: Sink) -> None:
    """Every process writes its stage's shards of the model and of each optimizer (see the module docstring)."""
    # The stage's own state dict (DTensors when sharded): torch's get_model_state_dict refuses a stage
    # without parameters, and this stage has no wrapper prefixes to clean.
    sharded.save_state_dict({"model": stage.state_dict()}, sharded.model_dir(folder, 0), sink=sink)
    for index, (optimizer, layout) in enumerate(zip(optimizers, layouts)):
        state, _ = _named_state(stage, optimizer, layout)
        sharded.save_state_dict({"optimizer": state}, sharded.optimizer_dir(folder, index), sink=sink)


def check_sharded(stage: nn.Module, optimizers: list[torch.optim.Optimizer], layouts: list[OptimizerLayout],
                  full_keys: set[str], folder: Path, *, strict: bool = True) -> None:
    """Refuse, before anything is loaded, a DCP checkpoint that lacks this stage's tensors or holds others'
    shapes; with ``strict``, also one holding keys the full model does not have.

    Raises:
        CheckpointError: naming the folder and the keys.
    """
    path = sharded.model_dir(folder, 0)
    saved = sharded.saved_tensor_shapes(path, "model")
    expected = {key: tuple(value.shape) for key, value in stage.state_dict().items()}
    problems = {"missing keys": sorted(set(expected) - set(saved)),
                "keys the model does not have": sorted(set(saved) - full_keys) if strict else [],
                "shape mismatches": [f"{key}: saved {saved[key]} vs model {shape}" for key, shape in expected.items()
                                     if key in saved and saved[key] != shape]}
    for index, (optimizer, layout) in enumerate(zip(optimizers, layouts)):
        path_i = sharded.optimizer_dir(folder, index)
        params = {name: tuple(p.shape) for name, p in stage.named_parameters()}
        names = set(chain.from_iterable(layout))
        saved_state = sharded.saved_tensor_shapes(path_i, "optimizer.state")
        groups = {key.split(".")[0] for key in _bytes_keys(path_i, "optimizer.param_groups")}
        if groups and len(groups) != len(optimizer.param_groups):
            problems[f"{path_i.name}: parameter groups (saved {len(groups)}, now {len(optimizer.param_groups)})"] = ["!"]
        for key, shape in saved_state.items():
            owner = max((name for name in names if key.startswith(name + ".")), key=len, default=None)
            if owner is None:
                problems.setdefault(f"{path_i.name}: state of parameters the model lacks", []).append(key)
            elif owner in params and len(shape) == len(params[owner]) and shape != params[owner]:
                problems["shape mismatches"].append(f"{key}: saved {shape} vs parameter {params[owner]}")
    found = [f"{label} {items[:8]}" if items != ["!"] else label for label, items in problems.items() if items]
    if found:
        raise CheckpointError(f"{folder} does not match this pipeline stage: " + "; ".join(found) + ". Nothing was "
                              "loaded.")


def check_shapes(stage: nn.Module, weights: dict[str, torch.Tensor], path: Path) -> None:
    """Refuse full ``weights`` that lack a tensor of this (sharded) stage or hold one of another global shape.

    Raises:
        CheckpointError: naming the file and the keys.
    """
    expected = {key: tuple(value.shape) for key, value in stage.state_dict().items()}
    missing = sorted(set(expected) - set(weights))
    wrong = [f"{key}: saved {tuple(weights[key].shape)} vs model {shape}" for key, shape in expected.items()
             if key in weights and tuple(weights[key].shape) != shape]
    if missing or wrong:
        raise CheckpointError(f"{path} does not match this pipeline stage: missing keys {missing[:8]}, shape "
                              f"mismatches {wrong[:8]}. Nothing was loaded.")


def _bytes_keys(path: Path, prefix: str) -> list[str]:
    """The keys under ``prefix`` of a DCP folder's non-tensor items, without the prefix."""
    lead = prefix + "."
    return [key[len(lead):] for key in sharded.read_metadata(path).state_dict_metadata if key.startswith(lead)]


def load_sharded(stage: nn.Module, optimizers: list[torch.optim.Optimizer], layouts: list[OptimizerLayout],
                 folder: Path) -> None:
    """Every process reads its stage's tensors (resharded onto its shards, if any) and optimizer state."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    weights = {"model": stage.state_dict()}
    sharded.load_state_dict(weights, sharded.model_dir(folder, 0))  # into the tensors (or shards) themselves
    stage.load_state_dict(weights["model"])
    for index, (optimizer, layout) in enumerate(zip(optimizers, layouts)):
        state, own = _named_state(stage, optimizer, layout)
        holder = {"optimizer": state}
        sharded.load_state_dict(holder, sharded.optimizer_dir(folder, index))
        loaded = holder["optimizer"]
        if not _holds_parameters(stage):
            for group, saved in zip(optimizer.param_groups, loaded["param_groups"]):
                group.update({key: value for key, value in saved.items() if key != "params"})
            continue
        loaded["param_groups"] = [{**group, "params": names} for group, names in zip(loaded["param_groups"], own)]
        set_optimizer_state_dict(stage, optimizer, loaded)


def load_full_into_sharded(stage: nn.Module, weights: dict[str, torch.Tensor], optimizers: list[torch.optim.Optimizer],
                           states: list[dict[str, Any]]) -> None:
    """Load the single-process format's tensors (every process holds them whole) into a sharded stage."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(stage, cast(dict[str, Any], weights), options=options)
    for optimizer, state in zip(optimizers, states):
        set_optimizer_state_dict(stage, optimizer, named_stage_optimizer_state(state, stage, optimizer), options=options)


def _holds_parameters(stage: nn.Module) -> bool:
    return any(True for _ in stage.parameters())


def _to_cpu(state: dict[str, Any]) -> dict[str, Any]:
    return {key: value.detach().cpu() if isinstance(value, torch.Tensor) else value for key, value in state.items()}


__all__ = ["OptimizerLayout", "check_shapes", "check_sharded", "checked_layout", "full_optimizer_state", "full_weights", "load_sharded",
           "load_full_into_sharded", "merged_optimizer_state", "named_optimizer_state", "named_stage_optimizer_state",
           "optimizer_layout", "optimizer_state_for_stage", "save_sharded", "stage_optimizer_state"]
