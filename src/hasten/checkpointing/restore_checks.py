"""Checks ``load_state`` runs before it changes anything: optimizer layout, process count, RNG files."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hasten.checkpointing.rng import CheckpointError, capture_rng_state, restore_rng_state

_RNG_RE = re.compile(r"^random_states_(\d+)\.pkl$")
_GRADIENTS_RE = re.compile(r"^accumulated_gradients(?:_\d+)?_rank(\d+)\.safetensors$")


def check_optimizer_state(optimizer: torch.optim.Optimizer, state: Mapping[str, Any], path: Path) -> None:
    """Raise unless ``state`` fits ``optimizer``: same parameter groups, sizes and state shapes."""
    groups = optimizer.param_groups
    saved_groups = state.get("param_groups") if isinstance(state, Mapping) else None
    if not isinstance(saved_groups, list) or not isinstance(state.get("state"), Mapping):
        raise CheckpointError(f"{path} is not an optimizer state (no 'state'/'param_groups'). Nothing was loaded.")
    if len(saved_groups) != len(groups):
        raise CheckpointError(f"{path} holds {len(saved_groups)} parameter groups but the optimizer has {len(groups)}; "
                              "create the optimizer with the same groups before load_state. Nothing was loaded.")
    saved_sizes = [len(g.get("params", ())) for g in saved_groups]
    sizes = [len(g["params"]) for g in groups]
    if saved_sizes != sizes:
        raise CheckpointError(f"{path} holds parameter groups of sizes {saved_sizes} but the optimizer's are {sizes}; "
                              "the model or optimizer differs from the saved one. Nothing was loaded.")
    params = {pid: p for g_saved, g in zip(saved_groups, groups) for pid, p in zip(g_saved["params"], g["params"])}
    for pid, entry in state["state"].items():
        param = params.get(pid)
        if param is None:
            raise CheckpointError(f"{path} holds state for parameter id {pid}, which no parameter group lists. "
                                  "Nothing was loaded.")
        for key, value in (entry.items() if isinstance(entry, Mapping) else ()):
            if isinstance(value, torch.Tensor) and value.dim() == param.dim() and value.shape != param.shape:
                raise CheckpointError(f"{path}: optimizer state {key!r} of parameter {pid} has shape "
                                      f"{tuple(value.shape)} but the parameter is {tuple(param.shape)}. Nothing was "
                                      "loaded.")


def saved_process_count(folder: Path, manifest: Mapping[str, Any] | None) -> int:
    """How many processes saved ``folder``: the manifest's count, else the highest RNG file + 1."""
    if manifest is not None:
        return int(manifest["num_processes"])
    ranks = [int(m.group(1)) for name in os.listdir(folder) if (m := _RNG_RE.match(name))]
    return max(ranks) + 1 if ranks else 0


def check_process_count(folder: Path, manifest: Mapping[str, Any] | None, num_processes: int,
                        loader_states: list[Mapping[str, Any]]) -> str | None:
    """Accept a checkpoint saved by more processes than run now; return the warning to print (or None).

    Refused: more processes now than at save time (the extra ones have no random state), partial
    gradients of processes that no longer exist, and data loaders saved in the middle of an epoch (the
    position of each process in the epoch does not carry over to another number of processes).
    """
    saved = saved_process_count(folder, manifest)
    if saved == 0 or saved == num_processes:
        return None
    if saved < num_processes:
        raise CheckpointError(f"{folder} was saved by {saved} process(es) but this run has {num_processes}: the "
                              f"processes {saved}..{num_processes - 1} would have no random generator state. Resume "
                              f"with at most {saved} processes (hasten launch --num_processes {saved}).")
    gradients = sorted(name for name in os.listdir(folder)
                       if (m := _GRADIENTS_RE.match(name)) and int(m.group(1)) >= num_processes)
    if gradients:
        raise CheckpointError(f"{folder} was saved by {saved} processes inside a gradient-accumulation window; the "
                              f"partial gradients of the processes this run lacks ({', '.join(gradients[:4])}) cannot "
                              f"be mapped onto {num_processes}. Resume with {saved} processes, or from a checkpoint "
                              "saved at an optimizer step.")
    mid_epoch = [i for i, state in enumerate(loader_states) if int(state.get("batches_yielded", 0))]
    if mid_epoch:
        raise CheckpointError(f"{folder} was saved by {saved} processes in the middle of an epoch (data loaders "
                              f"{mid_epoch}); how far each process got does not map onto {num_processes} processes. "
                              f"Resume with {saved} processes, or from a checkpoint saved at an epoch boundary.")
    dropped = ", ".join(f"random_states_{r}.pkl" for r in range(num_processes, saved))
    return (f"{folder} was saved by {saved} processes and is loaded into {num_processes}: dropped the random "
            f"generator states of processes {num_processes}..{saved - 1} ({dropped}); the data loader (sampler) "
            "states are at an epoch boundary and carry over unchanged.")


def missing_rng_message(folder: Path, rng_path: Path, manifest: Mapping[str, Any] | None, process_index: int,
                        num_processes: int) -> str:
    """The error for a missing ``random_states_{rank}.pkl``, saying what the folder does hold."""
    present = sorted(name for name in os.listdir(folder) if _RNG_RE.match(name))
    saved = saved_process_count(folder, manifest)
    held = f"it holds {', '.join(present[:4])}" if present else "it holds no random_states_*.pkl file at all"
    origin = f"saved by {saved} process(es) according to its manifest" if manifest is not None else "no manifest"
    return (f"Checkpoint file {rng_path} is missing ({origin}; {held}); process {process_index} of {num_processes} "
            "needs it to restore its random generators. The folder is incomplete or was modified; load another "
            "checkpoint.")


def check_rng_state(state: dict[str, Any], path: Path) -> None:
    """Restore ``state`` once and put the current generators back: proves it loads, changes nothing."""
    current = capture_rng_state(0)
    try:
        restore_rng_state(state, path)
    finally:
        restore_rng_state(current, path)


__all__ = ["check_optimizer_state", "check_process_count", "check_rng_state", "missing_rng_message",
           "saved_process_count"]
