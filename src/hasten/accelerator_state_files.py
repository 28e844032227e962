"""Accelerate's ``save_accelerator_state`` / ``load_accelerator_state``: the checkpoint folder written from
already-collected states, with hasten's file layout (Accelerate's names) and crash-safe writers.

``Accelerator.save_state`` / ``load_state`` are the usual way (they also seal, publish and check the folder
as a whole); these two functions serve code that assembles the states itself, as Accelerate's
``save_state`` does internally.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hasten.checkpointing import files
from hasten.checkpointing.rng import capture_rng_state, restore_rng_state
from hasten.state_helpers import save


def save_accelerator_state(output_dir: str | os.PathLike[str], model_states: list[dict[str, Any]],
                           optimizers: list[Any], schedulers: list[Any], dataloaders: list[Any],
                           process_index: int, step: int, scaler: Any = None, save_on_each_node: bool = False,
                           safe_serialization: bool = True) -> Path:
    """Write models (``model{_i}.safetensors`` or ``pytorch_model{_i}.bin``), optimizers, schedulers,
    resumable data loaders' positions, the scaler (main process, or each machine's first process with
    ``save_on_each_node``) and this process's generator states with ``step``. Returns the folder.

    Example:
        >>> save_accelerator_state("ckpt", [model.state_dict()], [opt], [], [], process_index=0, step=0)
    """
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    for i, state in enumerate(model_states):
        name = (files.SAFE_MODEL if safe_serialization else files.BIN_MODEL).format(suffix=files.suffix(i))
        save(state, folder / name, save_on_each_node=save_on_each_node, safe_serialization=safe_serialization)
    for pattern, objects in ((files.OPTIMIZER, optimizers), (files.SCHEDULER, schedulers)):
        for i, obj in enumerate(objects):
            save(obj.state_dict(), folder / pattern.format(suffix=files.suffix(i)), save_on_each_node=save_on_each_node)
    for i, loader in enumerate(dataloaders):
        if hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict"):
            save(loader.state_dict(), folder / files.DATALOADER.format(suffix=files.suffix(i)),
                 save_on_each_node=save_on_each_node)
    if scaler is not None:
        save(scaler.state_dict(), folder / files.SCALER, save_on_each_node=save_on_each_node)
    files.torch_save(capture_rng_state(step), folder / files.RNG.format(rank=process_index))
    return folder


def load_accelerator_state(input_dir: str | os.PathLike[str], models: list[Any], optimizers: list[Any],
                           schedulers: list[Any], dataloaders: list[Any], process_index: int, scaler: Any = None,
                           map_location: Any = None, load_kwargs: dict[str, Any] | None = None,
                           **load_model_func_kwargs: Any) -> dict[str, Any]:
    """Load what :func:`save_accelerator_state` (or Accelerate's) wrote into the given objects; restores this
    process's generators. Returns ``{"step": ...}`` (Accelerate's override attributes).

    ``load_model_func_kwargs`` go to the models' ``load_state_dict`` (``strict``); ``map_location``
    places optimizer states (default ``"cpu"``); files are read weights-only.

    Raises:
        CheckpointError: a file is missing, truncated, or does not match its object (named in the message).
    """
    folder = Path(input_dir)
    strict = bool(load_model_func_kwargs.get("strict", True))
    for i, model in enumerate(models):
        path, weights = files.read_model_weights(folder, i)
        files.check_model_weights(model, weights, path, strict=strict)
        files.load_model_weights(model, weights, strict=strict)
    location = map_location if map_location not in (None, "on_device") else "cpu"
    for pattern, objects in ((files.OPTIMIZER, optimizers), (files.SCHEDULER, schedulers)):
        for i, obj in enumerate(objects):
            obj.load_state_dict(files.torch_load(folder / pattern.format(suffix=files.suffix(i)), map_location=location))
    for i, loader in enumerate(dataloaders):
        path = folder / files.DATALOADER.format(suffix=files.suffix(i))
        if path.is_file() and hasattr(loader, "load_state_dict"):
            loader.load_state_dict(files.torch_load(path))
    if scaler is not None and (folder / files.SCALER).is_file():
        scaler.load_state_dict(files.torch_load(folder / files.SCALER))
    rng = folder / files.RNG.format(rank=process_index)
    step = restore_rng_state(files.load_registered_state(rng), rng) if rng.is_file() else 0
    return {"step": step}


__all__ = ["load_accelerator_state", "save_accelerator_state"]
