"""Accelerate's ``save_accelerator_state`` / ``load_accelerator_state``: the checkpoint folder written from
already-collected states, with hasten's file layout (Accelerate's names) and crash-safe writers.

``Accelerator.save_state`` / ``load_state`` are the usual way (they also seal, publish and check the folder
as a whole); these two functions serve code that assembles the states itself, as Accelerate's
``save_state`` does internally.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hasten.checkpointing import files
from hasten.checkpointing.rng import capture_rng_state, restore_rng_state
from hasten.exceptions import ConfigurationError
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


def check_load_kwargs(call: str, load_kwargs: Mapping[str, Any] | None) -> None:
    """Check Accelerate's ``load_kwargs`` (its options for ``torch.load`` of optimizer and scheduler files).

    hasten reads those files itself, with ``torch.load(weights_only=True)`` and an allow-list (and
    ``map_location`` from the call's own argument), so ``{"weights_only": True}`` is all it can honour;
    anything else is refused rather than dropped.

    Raises:
        ConfigurationError: names the keys and the fix.
    """
    options = dict(load_kwargs or {})
    if options.get("weights_only", True) is True:
        options.pop("weights_only", None)
    else:
        raise ConfigurationError(
            f"{call}(load_kwargs={{'weights_only': {options['weights_only']!r}}}): hasten reads every checkpoint file "
            "with weights_only=True and an allow-list, so a file never runs code. To load a class of your own in a "
            "registered object, trust it with hasten.checkpointing.add_safe_types(<class>) before loading.")
    if options:
        raise ConfigurationError(
            f"{call}(load_kwargs=...) got options hasten does not use: {', '.join(sorted(options))}. hasten reads "
            "optimizer and scheduler files itself (torch.load(weights_only=True), placed by map_location); "
            "remove them.")


def load_accelerator_state(input_dir: str | os.PathLike[str], models: list[Any], optimizers: list[Any],
                           schedulers: list[Any], dataloaders: list[Any], process_index: int, scaler: Any = None,
                           map_location: Any = None, load_kwargs: dict[str, Any] | None = None,
                           **load_model_func_kwargs: Any) -> dict[str, Any]:
    """Load what :func:`save_accelerator_state` (or Accelerate's) wrote into the given objects; restores this
    process's generators. Returns ``{"step": ...}`` (Accelerate's override attributes).

    ``load_model_func_kwargs`` go to the models' ``load_state_dict`` (``strict``, as Accelerate's
    ``load_model`` takes); ``map_location`` places optimizer states (default ``"cpu"``); files are read
    weights-only (``load_kwargs``: see :func:`check_load_kwargs`).

    Raises:
        ConfigurationError: ``load_kwargs`` or ``load_model_func_kwargs`` it does not use (named).
        CheckpointError: a file is missing, truncated, or does not match its object (named in the message).
    """
    check_load_kwargs("load_accelerator_state", load_kwargs)
    unused = sorted(set(load_model_func_kwargs) - {"strict"})
    if unused:
        raise ConfigurationError(f"load_accelerator_state() got keyword arguments it does not use: {', '.join(unused)}; "
                                 "the models' loading takes `strict` only (as Accelerate's safetensors load_model).")
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


__all__ = ["check_load_kwargs", "load_accelerator_state", "save_accelerator_state"]
