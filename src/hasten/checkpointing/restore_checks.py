"""Checks ``load_state`` runs before it changes anything: optimizer layout, process count, RNG files."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeGuard

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


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def saved_process_count(folder: Path, manifest: Mapping[str, Any] | None) -> int:
    """How many processes saved ``folder``: the manifest's count, else the highest RNG file + 1."""
    if manifest is not None:
        return int(manifest["num_processes"])
    ranks = [int(m.group(1)) for name in os.listdir(folder) if (m := _RNG_RE.match(name))]
    return max(ranks) + 1 if ranks else 0


def check_process_count(folder: Path, manifest: Mapping[str, Any] | None, num_processes: int,
                        loader_states: list[Mapping[str, Any]]) -> str | None:
    """Accept a checkpoint saved by another number of processes; return the warning to print (or None).

    Refused (the same message on every process, before anything changed): partial gradients saved
    inside an accumulation window (each process's own; they do not map onto another count), and data
    loaders saved mid-epoch by an older hasten, whose state holds only each process's batch count.
    Data loaders of this version store their position as a global sample count and are checked by the
    loaders themselves (``check_state_dict``).
    """
    saved = saved_process_count(folder, manifest)
    if saved == 0 or saved == num_processes:
        return None
    gradients = sorted(name for name in os.listdir(folder) if _GRADIENTS_RE.match(name))
    if gradients:
        raise CheckpointError(f"{folder} was saved by {saved} processes inside a gradient-accumulation window; the "
                              f"partial gradients of each process ({', '.join(gradients[:4])}) cannot be mapped onto "
                              f"{num_processes} processes. Resume with {saved} processes, or from a checkpoint saved "
                              "at an optimizer step.")
    old = [i for i, state in enumerate(loader_states)
           if int(state.get("batches_yielded", 0)) and "samples_yielded" not in state and "num_processes" not in state]
    if old:
        raise CheckpointError(f"{folder} was saved by {saved} processes in the middle of an epoch by an older hasten "
                              f"(data loaders {old} store each process's batch count, not a global sample count); "
                              f"the position does not map onto {num_processes} processes. Resume with {saved} "
                              "processes, or from a checkpoint saved at an epoch boundary.")
    if saved > num_processes:
        # At most a few names: the count comes from the folder (a crafted one must not size the message).
        dropped = ", ".join(f"random_states_{r}.pkl" for r in range(num_processes, min(saved, num_processes + 4)))
        dropped += f", ... random_states_{saved - 1}.pkl" if saved > num_processes + 4 else ""
        return (f"{folder} was saved by {saved} processes and is loaded into {num_processes}: dropped the random "
                f"generator states of processes {num_processes}..{saved - 1} ({dropped}); data loaders continue at "
                "the saved global sample.")
    return (f"{folder} was saved by {saved} processes and is loaded into {num_processes}: processes "
            f"{saved}..{num_processes - 1} have no random generator state and derive one from process "
            f"(rank % {saved})'s (see derive_rng_state); data loaders continue at the saved global sample.")


def rng_source(folder: Path, manifest: Mapping[str, Any] | None, process_index: int,
               num_processes: int) -> tuple[Path, bool]:
    """The ``random_states_*.pkl`` this process restores, and whether its state must be derived.

    A process that existed at save time reads its own file. A process the saving run did not have
    (``process_index >= saved``) reads ``random_states_{process_index % saved}.pkl`` and derives its own
    state from it (:func:`hasten.checkpointing.rng.derive_rng_state`).
    """
    saved = saved_process_count(folder, manifest)
    if 0 < saved <= process_index:
        return folder / f"random_states_{process_index % saved}.pkl", True
    return folder / f"random_states_{process_index}.pkl", False


_STEP_LIMIT = 1 << 62


def _refuse_field(path: Path, field: str, value: Any, meaning: str) -> None:
    raise CheckpointError(f"{path}: field {field!r} = {repr(value)[:40]} is not {meaning}; the file is damaged or "
                          "crafted. Nothing was loaded.")


def check_scheduler_state(scheduler: Any, state: Any, path: Path) -> None:
    """The counters and learning-rate lists of a saved scheduler state against the prepared scheduler.

    Only fields the prepared scheduler's own ``state_dict`` has are compared (any scheduler class works):
    ``last_epoch`` (an int >= -1), ``_step_count`` (an int >= 0), and ``base_lrs``/``_last_lr`` (one per
    parameter group).
    """
    if not isinstance(state, Mapping):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a scheduler state. Nothing was loaded.")
    current = scheduler.state_dict()
    if not isinstance(current, Mapping):
        return
    for field, low in (("last_epoch", -1), ("_step_count", 0)):
        if field in current and field in state:
            value = state[field]
            if not _is_int(value) or not low <= value < _STEP_LIMIT:
                _refuse_field(path, field, value, f"a step counter (an integer >= {low})")
    for field in ("base_lrs", "_last_lr"):
        if isinstance(current.get(field), list) and field in state:
            saved = state[field]
            if not isinstance(saved, list) or len(saved) != len(current[field]):
                count = len(saved) if isinstance(saved, list) else type(saved).__name__
                raise CheckpointError(f"{path}: field {field!r} holds {count} learning rates but the prepared "
                                      f"scheduler has {len(current[field])} (one per parameter group); the optimizer "
                                      "differs from the saved one, or the file is damaged. Nothing was loaded.")


def check_scaler_state(state: Any, path: Path) -> None:
    """A saved ``GradScaler`` state: a finite positive scale, growth > 1 > backoff > 0, counters >= 0."""
    if not isinstance(state, Mapping):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a loss scaler state. Nothing was loaded.")
    real = {"scale": (0.0, math.inf, "a loss scale (finite, > 0)"),
            "growth_factor": (1.0, math.inf, "a growth factor (finite, > 1)"),
            "backoff_factor": (0.0, 1.0, "a backoff factor (between 0 and 1)")}
    for field, (low, high, meaning) in real.items():
        value = state.get(field)
        if field in state and (not isinstance(value, (int, float)) or isinstance(value, bool)
                               or not math.isfinite(value) or not low < value < high):
            _refuse_field(path, field, value, meaning)
    for field, low in (("growth_interval", 1), ("_growth_tracker", 0)):
        value = state.get(field)
        if field in state and (not _is_int(value) or not low <= value < _STEP_LIMIT):
            _refuse_field(path, field, value, f"a step count (an integer >= {low})")


def check_loader_states(folder: Path, loaders: list[Any], states: list[Mapping[str, Any]]) -> None:
    """Ask each loader whether it can take its saved state (``check_state_dict``: every field in range, a
    position its layout can start at); raise naming the file if not."""
    for i, (loader, state) in enumerate(zip(loaders, states)):
        check = getattr(loader, "check_state_dict", None)
        if check is None:
            continue
        path = folder / f"dataloader_state{'' if i == 0 else f'_{i}'}.bin"
        if not isinstance(state, Mapping):
            raise CheckpointError(f"{path}: data loader #{i}: the file holds a {type(state).__name__}, not a data "
                                  "loader state. Nothing was loaded.")
        try:
            check(state)
        except (ValueError, TypeError) as exc:
            raise CheckpointError(f"{path}: data loader #{i}: {exc}. Nothing was loaded.") from exc


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


def check_rng_fields(state: Any, path: Path) -> None:
    """The numbers of a ``random_states_{rank}.pkl`` hasten reads itself: the step counter (an int >= 0) and
    the number of CUDA generator states; CheckpointError naming the file, field and value otherwise."""
    if not isinstance(state, Mapping):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not random generator states. Nothing was "
                              "loaded.")
    step = state.get("step", 0)
    if not _is_int(step) or not 0 <= step < 1 << 62:
        raise CheckpointError(f"{path}: field 'step' = {repr(step)[:40]} is not a step counter (an integer >= 0); "
                              "the file is damaged or crafted. Nothing was loaded.")
    cuda = state.get("torch_cuda_manual_seed")
    if cuda is not None and (not isinstance(cuda, (list, tuple)) or len(cuda) > 1 << 16):
        raise CheckpointError(f"{path}: field 'torch_cuda_manual_seed' holds "
                              f"{len(cuda) if isinstance(cuda, (list, tuple)) else type(cuda).__name__} entries, "
                              "not one generator state per CUDA device. Nothing was loaded.")


def check_rng_state(state: dict[str, Any], path: Path) -> None:
    """Check its fields, restore ``state`` once and put the current generators back: proves it loads,
    changes nothing."""
    check_rng_fields(state, path)
    current = capture_rng_state(0)
    try:
        restore_rng_state(state, path)
    finally:
        restore_rng_state(current, path)


__all__ = ["check_loader_states", "check_optimizer_state", "check_process_count", "check_rng_fields", "check_rng_state",
           "check_scaler_state", "check_scheduler_state",
           "missing_rng_message", "rng_source", "saved_process_count"]
