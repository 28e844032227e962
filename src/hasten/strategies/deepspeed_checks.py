"""What a DeepSpeed checkpoint must match before its engine loads any of it.

``engine.load_checkpoint`` copies the module's tensors first and fails on a mismatch only afterwards
(torch's ``load_state_dict`` copies every tensor that fits before it reports the others), then loads
the ZeRO optimizer shards, which fail on their own mismatches after the weights changed. So hasten reads
the engine's model-states file itself (it was already read once by the safety pass) and compares it
with the prepared engine: parameter and buffer names (with ``strict``), full shapes (ZeRO-3 partitions
included, through DeepSpeed's ``param_shapes``), the optimizer's parameter groups, and the counters the
engine reads back (process counts, steps, samples). Any difference raises ``CheckpointError`` naming the
file, before anything was loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeGuard

import torch

from hasten.checkpointing.restore_checks import check_optimizer_state
from hasten.exceptions import CheckpointError

#: Bounds far above any real run.
_MAX_PROCESSES = 1 << 20
_MAX_COUNT = 1 << 62


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def check_engine_checkpoint(engine: Any, path: Path, states: Any, optimizer_files: int, *, strict: bool) -> None:
    """Compare the model-states file ``path`` (already read into ``states``) with the prepared ``engine``.

    Args:
        engine: the prepared ``DeepSpeedEngine``.
        path: the ``*model_states.pt`` file (named in errors).
        states: its content.
        optimizer_files: how many ``*optim_states.pt`` shards the folder holds.
        strict: names must match exactly (else only the shapes of the names both have).

    Raises:
        CheckpointError: naming the file and every difference found (at most 8 of each kind).
    """
    if not isinstance(states, Mapping) or not isinstance(states.get("module"), Mapping):
        raise CheckpointError(f"{path} holds no module state (no 'module' entry); the file is damaged or was not "
                              "written by DeepSpeed. Nothing was loaded.")
    _check_counters(engine, path, states, optimizer_files)
    saved = _saved_shapes(path, states)
    expected = _engine_shapes(engine)
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    wrong = [f"{k}: file {saved[k]} vs model {expected[k]}" for k in expected if k in saved and saved[k] != expected[k]]
    problems = [f"{label} {items[:8]}{' ...' if len(items) > 8 else ''}"
                for label, items, shown in (("missing keys", missing, strict), ("unexpected keys", unexpected, strict),
                                            ("shape mismatches", wrong, True)) if items and shown]
    if problems:
        raise CheckpointError(f"{path} does not match the prepared model {type(engine.module).__name__}: "
                              + "; ".join(problems) + ". Nothing was loaded.")
    _check_groups(engine, path, states)


def _check_counters(engine: Any, path: Path, states: Mapping[str, Any], optimizer_files: int) -> None:
    """The numbers the engine reads back: process counts, steps and samples."""
    bounds = {"dp_world_size": (1, _MAX_PROCESSES, "a process count"), "mp_world_size": (1, _MAX_PROCESSES,
              "a process count"), "global_steps": (0, _MAX_COUNT, "a step counter"),
              "global_samples": (0, _MAX_COUNT, "a sample counter"), "skipped_steps": (0, _MAX_COUNT, "a step counter")}
    for field, (low, high, meaning) in bounds.items():
        value = states.get(field)
        if field in states and (not _is_int(value) or not low <= value <= high):
            raise CheckpointError(f"{path}: field {field!r} = {repr(value)[:40]} is not {meaning} (an integer from "
                                  f"{low} to {high}); the file is damaged or crafted. Nothing was loaded.")
    saved = states.get("dp_world_size")
    if engine.zero_optimization() and saved is not None and saved * states.get("mp_world_size", 1) != optimizer_files:
        raise CheckpointError(f"{path}: field 'dp_world_size' = {saved} but the folder holds {optimizer_files} ZeRO "
                              "optimizer shard(s) (*optim_states.pt, one per process): a shard is missing or the file "
                              "is crafted. Nothing was loaded.")


def _shape(path: Path, name: Any, shape: Any) -> tuple[int, ...]:
    if not isinstance(name, str) or not isinstance(shape, (tuple, list, torch.Size)) \
            or not all(_is_int(d) and d >= 0 for d in shape):
        raise CheckpointError(f"{path}: the shape recorded for {str(name)[:80]!r} ({str(shape)[:40]}) is not a tensor "
                              "shape; the file is damaged or crafted. Nothing was loaded.")
    return tuple(shape)


def _saved_shapes(path: Path, states: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """``{name: full shape}``: the module's tensors, where ZeRO's ``param_shapes`` (partitioned and flattened
    parameters) and ``frozen_param_shapes`` give the full shapes."""
    shapes = {name: tuple(t.shape) for name, t in states["module"].items() if isinstance(t, torch.Tensor)}
    groups = states.get("param_shapes") or []
    frozen = states.get("frozen_param_shapes") or {}
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups) or not isinstance(frozen, Mapping):
        raise CheckpointError(f"{path}: 'param_shapes'/'frozen_param_shapes' are not name-to-shape tables; the file "
                              "is damaged or crafted. Nothing was loaded.")
    for table in [*groups, frozen]:
        for name, shape in table.items():
            shapes[name] = _shape(path, name, shape)
    return shapes


def _engine_shapes(engine: Any) -> dict[str, tuple[int, ...]]:
    """``{name: full shape}`` of the prepared module's state (ZeRO-3 parameters by their ``ds_shape``)."""
    module = engine.module
    params = {name: p for name, p in module.named_parameters(remove_duplicate=False)}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, tensor in module.state_dict().items():
        source = params.get(name, tensor)
        shape = getattr(source, "ds_shape", None)
        shapes[name] = tuple(shape if shape is not None else tensor.shape)
    return shapes


def _check_groups(engine: Any, path: Path, states: Mapping[str, Any]) -> None:
    """ZeRO flattens each optimizer parameter group: the saved groups must hold the same parameters."""
    saved = states.get("param_shapes")
    optimizer_state = states.get("optimizer")
    if not engine.zero_optimization() and isinstance(engine.optimizer, torch.optim.Optimizer) \
            and isinstance(optimizer_state, Mapping) and "param_groups" in optimizer_state:
        check_optimizer_state(engine.optimizer, optimizer_state, path)  # without ZeRO: torch's own state
        return
    if not engine.zero_optimization() or not isinstance(saved, list) or engine.optimizer is None:
        return
    live = engine._get_zero_param_shapes()  # DeepSpeed's own table, as it saves it
    saved_sets = [set(group) for group in saved]
    live_sets = [set(group) for group in live]
    if saved_sets != live_sets:
        raise CheckpointError(f"{path} holds {len(saved_sets)} optimizer parameter group(s) of sizes "
                              f"{[len(g) for g in saved_sets]} but the prepared optimizer has {len(live_sets)} of "
                              f"sizes {[len(g) for g in live_sets]} (or other parameters in them); build the optimizer "
                              "with the groups it was saved with. Nothing was loaded.")


__all__ = ["check_engine_checkpoint"]
