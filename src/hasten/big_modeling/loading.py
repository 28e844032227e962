"""Checkpoint loading for big models: ``load_checkpoint_in_model`` and ``load_state_dict``.

Each tensor is read on its own and placed straight on its target, one shard open at a time, so peak
memory stays near what the model keeps in RAM plus one tensor. ``.bin`` files go through
``torch.load(weights_only=True, mmap=True)``: no code from a checkpoint is ever executed.
Tensors mapped to ``"disk"`` in a safetensors checkpoint are not copied: the offload index points at
the checkpoint file and they are memory-mapped when needed.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from hasten.big_modeling.device_map import check_device_map
from hasten.big_modeling.offload import offload_weight, save_offload_index
from hasten.big_modeling.tensors import (
    find_tied_parameters,
    get_submodule_and_name,
    retie_parameters,
    set_module_tensor_to_device,
    str_to_dtype,
)

logger = logging.getLogger(__name__)

__all__ = ["load_checkpoint_in_model", "load_state_dict", "resolve_checkpoint_files"]

WEIGHTS_NAME = "pytorch_model.bin"
SAFE_WEIGHTS_NAME = "model.safetensors"
_ST_TORCH = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def resolve_checkpoint_files(checkpoint: str | os.PathLike[str]) -> list[str]:
    """The weight files behind ``checkpoint``: a file, a ``*.index.json``, or a folder holding one of those.

    Raises:
        ValueError: the path does not exist, the folder holds no weights or several index files.

    Example:
        >>> resolve_checkpoint_files("ckpt/")  # a folder with model.safetensors.index.json
        ['ckpt/model-00001-of-00002.safetensors', 'ckpt/model-00002-of-00002.safetensors']
    """
    path = Path(checkpoint)
    if not path.exists():
        raise ValueError(f"Checkpoint {os.fspath(checkpoint)!r} does not exist. HINT: pass a .safetensors/.bin "
                         "file, a *.index.json, or a folder containing one of them.")
    if path.is_file():
        return _index_files(path) if path.name.endswith(".json") else [str(path)]
    for name in (SAFE_WEIGHTS_NAME, WEIGHTS_NAME):
        if (path / name).is_file():
            return [str(path / name)]
    indexes = sorted(p for p in path.iterdir() if p.name.endswith(".index.json"))
    if len(indexes) > 1:
        raise ValueError(f"Checkpoint folder {str(path)!r} holds several index files "
                         f"({', '.join(p.name for p in indexes)}): pass the one to use as `checkpoint`.")
    if not indexes:
        raise ValueError(f"Checkpoint folder {str(path)!r} holds no {SAFE_WEIGHTS_NAME}, {WEIGHTS_NAME} or "
                         "*.index.json. HINT: pass the weight file itself.")
    return _index_files(indexes[0])


def _index_files(index_file: Path) -> list[str]:
    try:
        index = json.loads(index_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{str(index_file)!r} is not valid JSON ({exc}).") from exc
    weight_map = index.get("weight_map", index) if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{str(index_file)!r} is not a checkpoint index: expected {{'weight_map': {{name: file}}}}.")
    files = list(dict.fromkeys(weight_map.values()))
    missing = [f for f in files if not (index_file.parent / f).is_file()]
    if missing:
        raise ValueError(f"The index {str(index_file)!r} lists shard files that are missing: {', '.join(missing)}.")
    return [str(index_file.parent / f) for f in files]


class _Entry:
    """One tensor of a shard: its name, stored dtype, and how to read it."""

    __slots__ = ("name", "file", "stored_dtype", "_read")

    def __init__(self, name: str, file: str, stored_dtype: torch.dtype | None, read: Any) -> None:
        self.name, self.file, self.stored_dtype, self._read = name, file, stored_dtype, read

    def read(self) -> torch.Tensor:
        return self._read(self.name)

    @property
    def lazy_safetensors(self) -> bool:
        return self.file.endswith(".safetensors")


def _torch_load(path: str) -> dict[str, torch.Tensor]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # legacy (non-zip) files cannot be memory-mapped
        return torch.load(path, map_location="cpu", weights_only=True)


def _damaged(path: str, exc: Exception) -> Exception:
    from hasten.checkpointing import CheckpointError  # only on this error path

    return CheckpointError(f"The weight file {path!r} is damaged or is not a safetensors file ({type(exc).__name__}: "
                           f"{exc}). HINT: download or save that shard again.")


def _check_safetensors_files(files: list[str]) -> None:
    """Open every safetensors shard's header (no tensor data is read) so a damaged shard fails the load
    before any weight is placed."""
    for path in files:
        if path.endswith(".safetensors"):
            try:
                with safe_open(path, framework="pt", device="cpu") as handle:
                    handle.keys()
            except Exception as exc:  # noqa: BLE001 - safetensors raises its own SafetensorError, or OSError
                raise _damaged(path, exc) from exc


def _safetensors_entries(path: str) -> Iterator[_Entry]:
    def read(name: str) -> torch.Tensor:
        try:
            return handle.get_tensor(name)
        except Exception as exc:  # noqa: BLE001 - SafetensorError from a file damaged after its header
            raise _damaged(path, exc) from exc

    try:
        handle_context = safe_open(path, framework="pt", device="cpu")
    except Exception as exc:  # noqa: BLE001 - SafetensorError (bad header, truncated file) or OSError
        raise _damaged(path, exc) from exc
    with handle_context as handle:
        for name in handle.keys():
            stored = _ST_TORCH.get(handle.get_slice(name).get_dtype())
            yield _Entry(name, path, stored, read)


def _shard_entries(path: str) -> Iterator[_Entry]:
    """Yield the tensors of one shard; the file stays open (or mapped) only while iterating.

    Raises:
        CheckpointError: a safetensors shard is damaged (the message names the file).
    """
    if path.endswith(".safetensors"):
        yield from _safetensors_entries(path)
        return
    state_dict = _torch_load(path)
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"{path!r} does not hold a state dict (found {type(state_dict).__name__}).")
    for name in list(state_dict):
        tensor = state_dict[name]
        yield _Entry(name, path, tensor.dtype, lambda n, sd=state_dict: sd[n].clone())  # own memory, not the mmap
    del state_dict


def load_state_dict(checkpoint_file: str | os.PathLike[str],
                    device_map: Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """Read one weight file; with ``device_map`` each tensor goes to its device ("disk" ones stay on CPU).

    Example:
        >>> sd = load_state_dict("model.safetensors")
    """
    result: dict[str, torch.Tensor] = {}
    for entry in _shard_entries(os.fspath(checkpoint_file)):
        tensor = entry.read()
        if device_map is not None:
            device = _device_for(entry.name, device_map)
            if device not in (None, "disk"):
                tensor = tensor.to(device if not isinstance(device, int) else torch.device("cuda", device))
        result[entry.name] = tensor
    return result


def _device_for(name: str, device_map: Mapping[str, Any]) -> Any:
    """The device of the longest ``device_map`` key that is a prefix (module) of ``name``."""
    best, best_len = None, -1
    for key, device in device_map.items():
        if (key == "" or name == key or name.startswith(key + ".")) and len(key) > best_len:
            best, best_len = device, len(key)
    return best


def _target_dtype(name: str, stored: torch.dtype | None, dtype: torch.dtype | None,
                  keep_in_fp32_modules: list[str] | None) -> torch.dtype | None:
    if dtype is None or stored is None or not stored.is_floating_point:
        return None
    if keep_in_fp32_modules and dtype == torch.float16:
        for key in keep_in_fp32_modules:
            if key == name or name.startswith(key + ".") or f".{key}." in f".{name}":
                return torch.float32
    return dtype


def _check_device_map_values(device_map: Mapping[str, Any], offload_folder: Any) -> None:
    for key, device in device_map.items():
        if isinstance(device, (int, torch.device)) or device in ("cpu", "disk", "meta", "mps"):
            continue
        try:
            torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device_map[{key!r}] = {device!r} is not a device: use a GPU index, 'cpu', 'disk' "
                             "or a torch device string such as 'cuda:1'.") from exc
    if "disk" in [str(v) for v in device_map.values()] and offload_folder is None:
        raise ValueError("The device_map puts some weights on 'disk' but no `offload_folder` was given. HINT: pass "
                         "offload_folder='some/folder' (it receives the offloaded weights and their index.json).")


class _LoadReport:
    """What a load saw: keys loaded, keys the model does not have, weights sent to disk."""

    def __init__(self) -> None:
        self.loaded: set[str] = set()
        self.unexpected: list[str] = []
        self.offload_index: dict[str, Any] = {}


def _place(model: nn.Module, entry: _Entry, device: Any, new_dtype: torch.dtype | None, offload_folder: Any,
           is_buffer: bool, offload_buffers: bool, report: _LoadReport) -> None:
    """Put one checkpoint tensor where ``device`` says (disk entries become an offload-index record)."""
    if device == "disk" and (offload_buffers or not is_buffer):
        owner, leaf = get_submodule_and_name(model, entry.name)
        meta_dtype = new_dtype or entry.stored_dtype or getattr(owner, leaf).dtype
        set_module_tensor_to_device(model, entry.name, "meta", dtype=meta_dtype)
        if entry.lazy_safetensors:
            record: dict[str, Any] = {"safetensors_file": os.path.abspath(entry.file), "weight_name": entry.name}
            if new_dtype is not None and new_dtype != entry.stored_dtype:
                record["dtype"] = str(new_dtype).replace("torch.", "")
            report.offload_index[entry.name] = record
        else:
            value = entry.read()
            if new_dtype is not None:
                value = value.to(new_dtype)
            offload_weight(value, entry.name, offload_folder, index=report.offload_index)
        return
    if device == "disk":  # a buffer without offload_buffers stays in RAM
        device = "cpu"
    if isinstance(device, int):
        device = torch.device("cuda", device)
    set_module_tensor_to_device(model, entry.name, device, value=entry.read(), dtype=new_dtype)


def load_checkpoint_in_model(model: nn.Module, checkpoint: str | os.PathLike[str],
                             device_map: Mapping[str, Any] | None = None,
                             offload_folder: str | os.PathLike[str] | None = None,
                             dtype: str | torch.dtype | None = None, offload_state_dict: bool = False,
                             offload_buffers: bool = False, keep_in_fp32_modules: list[str] | None = None,
                             offload_8bit_bnb: bool = False, strict: bool = False, full_state_dict: bool = True,
                             broadcast_from_rank0: bool = False) -> None:
    """Load a checkpoint into ``model`` (possibly built with ``init_empty_weights``), tensor by tensor.

    Args:
        model: the model; its meta tensors get real values.
        checkpoint: a ``.safetensors``/``.bin`` file, a ``*.index.json`` or a folder holding one of them.
        device_map: module name -> device (int GPU index, ``"cpu"``, ``"disk"``); ``None`` keeps each tensor on
            its current device (``"cpu"`` for meta tensors).
        offload_folder: where ``"disk"`` weights go (required when the map contains ``"disk"``).
        dtype: cast floating-point weights to this dtype.
        offload_state_dict: accepted for compatibility; tensors are already streamed one at a time, so the
            temporary CPU offload Accelerate does to save RAM is not needed.
        offload_buffers: also offload the buffers of ``"disk"`` modules.
        keep_in_fp32_modules: modules kept in float32 when ``dtype`` is float16.
        offload_8bit_bnb: not supported (bitsandbytes); must be False.
        strict: raise on missing or unexpected keys instead of warning.
        full_state_dict: accepted for compatibility; every rank reads the file itself.
        broadcast_from_rank0: accepted for compatibility; every rank reads the file itself.

    Example:
        >>> with init_empty_weights():
        ...     model = MyModel()
        >>> load_checkpoint_in_model(model, "ckpt/", device_map={"": "cpu"})
    """
    if offload_8bit_bnb:
        raise ValueError("offload_8bit_bnb=True needs bitsandbytes quantization, which hasten does not support.")
    files = resolve_checkpoint_files(checkpoint)
    _check_safetensors_files(files)
    if device_map is not None:
        check_device_map(model, device_map)  # a module left out would silently stay empty
        _check_device_map_values(device_map, offload_folder)
    if offload_folder is not None:
        os.makedirs(offload_folder, exist_ok=True)
    torch_dtype = str_to_dtype(dtype) if dtype is not None else None
    tied = find_tied_parameters(model)
    expected = dict(model.state_dict(keep_vars=True))
    buffers = {name for name, _ in model.named_buffers()}
    report = _LoadReport()
    for file in files:
        for entry in _shard_entries(file):
            if entry.name not in expected:
                report.unexpected.append(entry.name)
                continue
            if device_map is not None:
                device = _device_for(entry.name, device_map)
            else:
                current = expected[entry.name].device
                device = "cpu" if current.type == "meta" else current
            new_dtype = _target_dtype(entry.name, entry.stored_dtype, torch_dtype, keep_in_fp32_modules)
            _place(model, entry, device, new_dtype, offload_folder, entry.name in buffers, offload_buffers, report)
            report.loaded.add(entry.name)
    if offload_folder is not None:
        save_offload_index(report.offload_index, offload_folder)
    retie_parameters(model, tied)
    _check_keys(model, report, tied, files, strict)



def _check_keys(model: nn.Module, report: _LoadReport, tied: list[list[str]], files: list[str], strict: bool) -> None:
    """Warn (or raise when ``strict``) about model keys the checkpoint lacks and keys the model lacks."""
    twins = {name: group for group in tied for name in group}
    missing = [name for name in model.state_dict(keep_vars=True)
               if name not in report.loaded and not any(t in report.loaded for t in twins.get(name, ()))]
    where = files[0] if len(files) == 1 else f"{len(files)} shards in {os.path.dirname(files[0])}"
    problems = []
    if missing:
        problems.append(f"keys of the model missing from the checkpoint: {', '.join(missing[:20])}"
                        + (" ..." if len(missing) > 20 else ""))
    if report.unexpected:
        problems.append(f"keys of the checkpoint the model does not have: {', '.join(report.unexpected[:20])}"
                        + (" ..." if len(report.unexpected) > 20 else ""))
    if not problems:
        return
    message = f"Loading {where}: " + "; ".join(problems) + "."
    if strict:
        raise ValueError(message + " HINT: check that the checkpoint was saved from this model class/config.")
    logger.warning(message)  # Accelerate logs mismatched keys (a warning filter cannot silence or raise on it)
