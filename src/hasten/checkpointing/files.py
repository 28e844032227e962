"""Reading and writing the individual files of a checkpoint folder, safely.

Writes go to the sink the caller hands over (:mod:`hasten.checkpointing.sinks`: sealed in a save's
staging folder, staged for an asynchronous save, else a temporary name and a rename); reads use
safetensors or ``torch.load(weights_only=True)`` (a checkpoint never runs code) and name the file on
any failure.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hasten.checkpointing import safe_load
from hasten.checkpointing.rng import CheckpointError
from hasten.checkpointing.sinks import ATOMIC, Sink, Writer

SAFE_MODEL = "model{suffix}.safetensors"
BIN_MODEL = "pytorch_model{suffix}.bin"
OPTIMIZER = "optimizer{suffix}.bin"
SCHEDULER = "scheduler{suffix}.bin"
DATALOADER = "dataloader_state{suffix}.bin"
SCALER = "scaler.pt"
RNG = "random_states_{rank}.pkl"
CUSTOM = "custom_checkpoint_{index}.pkl"
GRADIENTS = "accumulated_gradients{suffix}_rank{rank}.safetensors"


def suffix(index: int) -> str:
    """Accelerate's numbering: the first object has no suffix, the next ``_1``, ``_2``..."""
    return "" if index == 0 else f"_{index}"


def write_file(path: Path, write: Writer, state: Any, *, sink: Sink = ATOMIC) -> None:
    """Have ``write(state, file)`` produce ``path`` through ``sink``, complete and durable before a checkpoint
    publishes it.

    The save's sealed sink writes a file of its staging folder under its final name and seals it (CRC-32
    and fsync in the background); an asynchronous save's snapshot sink only stages ``state`` now and runs
    ``write`` later on the copy, so the file holds the same bytes; the atomic sink (the default, for
    files outside a save) goes through a temporary name, an fsync and a rename.
    """
    sink.write(path, write, state)


def _torch_write(obj: Any, file: Path) -> None:
    # torch.save names the archive inside the file after the file: writing the final name (an
    # asynchronous save's background thread too) gives the same bytes as a synchronous save.
    torch.save(obj, file)


def torch_save(obj: Any, path: Path, *, sink: Sink = ATOMIC) -> None:
    """``torch.save``, crash-safely (:func:`write_file`)."""
    write_file(path, _torch_write, obj, sink=sink)


def torch_load(path: Path, map_location: Any = "cpu") -> Any:
    """``torch.load(weights_only=True)``, naming the file when it is missing, truncated or unsafe."""
    return safe_load.torch_load(path, path, map_location=map_location)


def load_registered_state(path: Path) -> Any:
    """A registered object's state: tensors, builtins, NumPy values, datetime, pathlib, and the classes
    allowed with :func:`hasten.checkpointing.add_safe_types`."""
    return safe_load.torch_load(path, path, kind="registered")


def load_rng_file(path: Path) -> Any:
    """A ``random_states_{rank}.pkl``: tensors and builtins, or NumPy's state tuple (Accelerate's files)."""
    return safe_load.torch_load(path, path, kind="rng")


def _storage_key(tensor: torch.Tensor) -> tuple[Any, Any, tuple[int, ...]]:
    """Tensors with the same key are the same memory (tied weights)."""
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))


def dedupe_shared_tensors(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keep one name per storage (tied weights), as safetensors requires; tensors made contiguous."""
    seen: dict[tuple[Any, int, tuple[int, ...]], str] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            continue
        key = _storage_key(tensor)
        if tensor.device.type != "meta" and key in seen:
            continue
        seen[key] = name
        out[name] = tensor.detach().contiguous()
    return out


def save_model_weights(state_dict: Mapping[str, torch.Tensor], folder: Path, index: int, safe: bool, *,
                       sink: Sink = ATOMIC) -> Path:
    """Write one model's weights as ``model{_i}.safetensors`` (or ``pytorch_model{_i}.bin``)."""
    if safe:
        path = folder / SAFE_MODEL.format(suffix=suffix(index))
        # still on their device: an asynchronous save stages them (pinned copies from a GPU)
        write_file(path, _safetensors_write, dedupe_shared_tensors(state_dict), sink=sink)
        return path
    path = folder / BIN_MODEL.format(suffix=suffix(index))
    torch_save({k: v.cpu() for k, v in state_dict.items()}, path, sink=sink)
    return path


def read_model_weights(folder: Path, index: int) -> tuple[Path, dict[str, torch.Tensor]]:
    """Read one model's weights (safetensors preferred), naming the file on failure."""
    safe = folder / SAFE_MODEL.format(suffix=suffix(index))
    if safe.is_file():
        from safetensors.torch import load_file

        try:
            return safe, load_file(str(safe), device="cpu")
        except Exception as exc:
            raise CheckpointError(f"Could not read checkpoint file {safe}: {exc}. It is truncated or corrupted.") from exc
    binary = folder / BIN_MODEL.format(suffix=suffix(index))
    if binary.is_file():
        return binary, torch_load(binary)
    raise CheckpointError(f"{folder} has no weights for model #{index} (expected {safe.name} or {binary.name}); "
                          "the folder was saved with fewer models than were prepared.")


def check_model_weights(model: nn.Module, weights: Mapping[str, torch.Tensor], path: Path, strict: bool = True) -> None:
    """Compare keys and shapes before touching the model, so a mismatch never leaves it half-loaded.

    Names missing from the file are accepted when they share storage with a saved name (tied weights).
    """
    expected = model.state_dict()
    aliases = _storage_aliases(expected)
    missing = [k for k in expected if k not in weights and not any(a in weights for a in aliases.get(k, ()))]
    unexpected = [k for k in weights if k not in expected]
    wrong_shape = [f"{k}: file {tuple(weights[k].shape)} vs model {tuple(expected[k].shape)}"
                   for k in weights if k in expected and tuple(weights[k].shape) != tuple(expected[k].shape)]
    problems = []
    if strict and missing:
        problems.append(f"missing keys {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if strict and unexpected:
        problems.append(f"unexpected keys {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    if wrong_shape:
        problems.append(f"shape mismatches {wrong_shape[:8]}")
    if problems:
        raise CheckpointError(f"{path} does not match the prepared model {type(model).__name__}: "
                              + "; ".join(problems) + ". Nothing was loaded.")


def load_model_weights(model: nn.Module, weights: Mapping[str, torch.Tensor], strict: bool = True) -> None:
    """Copy checked weights into ``model`` (tied names restored from their saved alias)."""
    expected = model.state_dict()
    full = dict(weights)
    for name, names in _storage_aliases(expected).items():
        if name not in full:
            for alias in names:
                if alias in weights:
                    full[name] = weights[alias]
                    break
    model.load_state_dict(full, strict=strict)


def _storage_aliases(state_dict: Mapping[str, torch.Tensor]) -> dict[str, list[str]]:
    by_storage: dict[tuple[Any, int, tuple[int, ...]], list[str]] = {}
    for name, tensor in state_dict.items():
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
            by_storage.setdefault(_storage_key(tensor), []).append(name)
    return {n: [a for a in names if a != n] for names in by_storage.values() if len(names) > 1 for n in names}


def count_files(folder: Path, prefix: str) -> int:
    """How many ``{prefix}{_i}`` files of one kind the folder holds."""
    return sum(1 for name in os.listdir(folder) if name.startswith(prefix))


def save_gradients(model: nn.Module, path: Path) -> bool:
    """Write the gradients accumulated so far (a save in the middle of an accumulation window)."""
    grads = {name: p.grad.detach().cpu().contiguous() for name, p in model.named_parameters() if p.grad is not None}
    return save_gradient_tensors(grads, path)


def save_gradient_tensors(grads: Mapping[str, torch.Tensor], path: Path, *,
                          sink: Sink = ATOMIC) -> bool:
    """Write ``name -> gradient`` tensors (CPU, contiguous) through ``sink``; False when there are none."""
    if not grads:
        return False
    write_file(path, _safetensors_write, dict(grads), sink=sink)
    return True


def _safetensors_write(tensors: Mapping[str, torch.Tensor], file: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.cpu() for k, v in tensors.items()}, str(file), metadata={"format": "pt"})


def read_gradients(path: Path) -> dict[str, torch.Tensor]:
    """Read accumulated gradients, naming the file on failure."""
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device="cpu")
    except Exception as exc:
        raise CheckpointError(f"Could not read checkpoint file {path}: {exc}. It is truncated or corrupted.") from exc


def restore_gradients(model: nn.Module, grads: Mapping[str, torch.Tensor], path: Path) -> None:
    """Put accumulated gradients back on the parameters (names checked first)."""
    params = dict(model.named_parameters())
    unknown = [name for name in grads if name not in params]
    if unknown:
        raise CheckpointError(f"{path} holds gradients for parameters the model lacks: {unknown[:8]}")
    for name, grad in grads.items():
        params[name].grad = grad.to(params[name].device, dtype=params[name].dtype)
