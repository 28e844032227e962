"""Accelerate's disk-offload folder format, and the lazy weights map that reads it.

Folder layout (interoperable with Accelerate): one raw ``{name}.dat`` per tensor (C order, no header,
bf16 stored as int16 bits, 0-d tensors as shape ``(1,)``) and an ``index.json`` mapping each name to
``{"dtype", "shape"}``, or to ``{"safetensors_file", "weight_name", "dtype"}`` for weights read straight
from a checkpoint's safetensors file (nothing is copied).
"""

from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = ["OffloadedWeightsLoader", "PrefixedDataset", "extract_submodules_state_dict", "load_offloaded_weight",
           "load_offloaded_weights", "offload_state_dict", "offload_weight", "save_offload_index"]

# numpy has no bfloat16/float8: those are stored as raw integer bits of the same width.
_BIT_VIEWS = {torch.bfloat16: (torch.int16, "bfloat16"), torch.float8_e4m3fn: (torch.uint8, "float8_e4m3fn"),
              torch.float8_e5m2: (torch.uint8, "float8_e5m2")}
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_NP_OF_TORCH = {torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16,
                torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8,
                torch.uint8: np.uint8, torch.bool: np.bool_}


def offload_weight(weight: torch.Tensor, weight_name: str, offload_folder: str | os.PathLike[str],
                   index: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write ``weight`` to ``{offload_folder}/{weight_name}.dat`` and record it in ``index`` (returned).

    Example:
        >>> index = offload_weight(torch.ones(2, 2), "layer.weight", "offload")
        >>> index["layer.weight"]
        {'dtype': 'float32', 'shape': [2, 2]}
    """
    weight = weight.detach().cpu().contiguous()
    dtype_name = None
    if weight.dtype in _BIT_VIEWS:
        bits, dtype_name = _BIT_VIEWS[weight.dtype]
        weight = weight.view(bits)
    array = weight.numpy()
    if dtype_name is None:
        dtype_name = str(array.dtype)
    if array.ndim == 0:
        array = array[None]
    os.makedirs(offload_folder, exist_ok=True)
    path = os.path.join(os.fspath(offload_folder), f"{weight_name}.dat")
    if array.size:
        file_array = np.memmap(path, dtype=array.dtype, mode="w+", shape=array.shape)
        file_array[:] = array[:]
        file_array.flush()
        del file_array
    else:
        Path(path).write_bytes(b"")
    index = {} if index is None else index
    index[weight_name] = {"dtype": dtype_name, "shape": list(weight.shape)}
    return index


def _torch_dtype(name: str) -> torch.dtype:
    value = getattr(torch, name.replace("torch.", ""), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"Unknown dtype {name!r} in an offload index.")
    return value


def _map_dat(weight_file: str, weight_info: Mapping[str, Any]) -> torch.Tensor:
    """A tensor backed by the ``.dat`` file itself (copy-on-write mapping: no read until used)."""
    shape = tuple(weight_info["shape"])
    dtype = _torch_dtype(weight_info["dtype"])
    stored = _BIT_VIEWS.get(dtype, (dtype, ""))[0]
    if int(np.prod(shape or (1,))) == 0:
        return torch.empty(shape, dtype=dtype)
    array = np.memmap(weight_file, dtype=_NP_OF_TORCH[stored], mode="c", shape=shape or (1,))
    tensor = torch.from_numpy(array)
    if stored != dtype:
        tensor = tensor.view(dtype)
    return tensor[0] if not shape else tensor


def load_offloaded_weight(weight_file: str | os.PathLike[str], weight_info: Mapping[str, Any]) -> torch.Tensor:
    """Read one ``.dat`` file described by its index entry into a new CPU tensor.

    Example:
        >>> load_offloaded_weight("offload/layer.weight.dat", {"dtype": "float32", "shape": [2, 2]})
    """
    return _map_dat(os.fspath(weight_file), weight_info).clone()


def save_offload_index(index: Mapping[str, Any], offload_folder: str | os.PathLike[str]) -> None:
    """Merge ``index`` into ``{offload_folder}/index.json`` (created if needed).

    Example:
        >>> save_offload_index({"w": {"dtype": "float32", "shape": [1]}}, "offload")
    """
    if not index:
        return
    path = Path(offload_folder) / "index.json"
    current = json.loads(path.read_text()) if path.is_file() else {}
    current.update(index)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".index.json.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(current, indent=2))
    os.replace(tmp, path)  # readers never see a half-written index


def offload_state_dict(save_dir: str | os.PathLike[str], state_dict: Mapping[str, torch.Tensor]) -> None:
    """Write every tensor of ``state_dict`` into ``save_dir`` in the offload format, then its index.

    Example:
        >>> offload_state_dict("offload", model.state_dict())
    """
    os.makedirs(save_dir, exist_ok=True)
    index: dict[str, Any] = {}
    for name, tensor in state_dict.items():
        index = offload_weight(tensor, name, save_dir, index=index)
    save_offload_index(index, save_dir)


class _SafetensorsFile:
    """The header of one safetensors file, so its tensors can be memory-mapped one by one."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        header.pop("__metadata__", None)
        self.entries: dict[str, dict[str, Any]] = header
        self.data_start = 8 + length

    def tensor(self, name: str) -> torch.Tensor:
        info = self.entries.get(name)
        if info is None:
            raise KeyError(f"{name!r} is not in the safetensors file {self.path}.")
        dtype = _ST_DTYPES[info["dtype"]]
        shape = tuple(info["shape"])
        begin, end = info["data_offsets"]
        if end == begin:
            return torch.empty(shape, dtype=dtype)
        stored = _BIT_VIEWS.get(dtype, (dtype, ""))[0]
        array = np.memmap(self.path, dtype=_NP_OF_TORCH[stored], mode="c", offset=self.data_start + begin,
                          shape=shape or (1,))
        tensor = torch.from_numpy(array)
        if stored != dtype:
            tensor = tensor.view(dtype)
        return tensor[0] if not shape else tensor


_HEADERS: dict[str, _SafetensorsFile] = {}
_HEADERS_LOCK = threading.Lock()


def read_safetensors_lazily(path: str, name: str) -> torch.Tensor:
    """A CPU tensor memory-mapped from ``path`` (copy-on-write); the header is parsed once per file."""
    with _HEADERS_LOCK:
        entry = _HEADERS.get(path)
        if entry is None or os.stat(path).st_mtime_ns != getattr(entry, "mtime", None):
            entry = _SafetensorsFile(path)
            entry.mtime = os.stat(path).st_mtime_ns  # type: ignore[attr-defined]
            _HEADERS[path] = entry
    return entry.tensor(name)


class PrefixedDataset(Mapping):  # type: ignore[type-arg]
    """The view of ``dataset`` whose keys start with ``prefix`` (the prefix is removed).

    Example:
        >>> PrefixedDataset({"a.w": 1, "b.w": 2}, "a.")["w"]
        1
    """

    def __init__(self, dataset: Mapping[str, Any], prefix: str) -> None:
        self.dataset = dataset
        self.prefix = prefix

    def __getitem__(self, key: str) -> Any:
        return self.dataset[f"{self.prefix}{key}"]

    def __iter__(self) -> Iterator[str]:
        return iter([k[len(self.prefix):] for k in self.dataset if k.startswith(self.prefix)])

    def __len__(self) -> int:
        return sum(1 for k in self.dataset if k.startswith(self.prefix))

    def __contains__(self, key: object) -> bool:
        return f"{self.prefix}{key}" in self.dataset


class OffloadedWeightsLoader(Mapping):  # type: ignore[type-arg]
    """Weights by name: from ``state_dict`` (RAM) first, then the offload folder's ``index.json`` entries.

    Disk entries are memory-mapped (no copy until the tensor is used), whether ``.dat`` files or tensors
    inside a checkpoint's safetensors files.

    Example:
        >>> weights = OffloadedWeightsLoader(save_folder="offload")
        >>> weights["layer.weight"].shape
        torch.Size([2, 2])
    """

    def __init__(self, state_dict: Mapping[str, torch.Tensor] | None = None,
                 save_folder: str | os.PathLike[str] | None = None, index: Mapping[str, Any] | None = None,
                 device: Any = None) -> None:
        if state_dict is None and save_folder is None and index is None:
            raise ValueError("Need either a `state_dict`, a `save_folder` or an `index` containing offloaded weights.")
        self.state_dict = {} if state_dict is None else state_dict
        self.save_folder = None if save_folder is None else os.fspath(save_folder)
        if index is None and self.save_folder is not None:
            index_file = Path(self.save_folder) / "index.json"
            index = json.loads(index_file.read_text()) if index_file.is_file() else {}
        self.index = {} if index is None else dict(index)
        self.all_keys = list(self.state_dict)
        self.all_keys += [k for k in self.index if k not in self.state_dict]
        self.device = device

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.state_dict:
            return self.state_dict[key]
        info = self.index[key]
        if info.get("safetensors_file") is not None:
            tensor = read_safetensors_lazily(info["safetensors_file"], info.get("weight_name", key))
            if info.get("dtype"):
                tensor = tensor.to(_torch_dtype(info["dtype"]))
        else:
            if self.save_folder is None:
                raise KeyError(f"{key!r} is a .dat entry but the loader has no `save_folder`.")
            tensor = _map_dat(os.path.join(self.save_folder, f"{key}.dat"), info)
        if self.device is not None:
            tensor = tensor.to(self.device)
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self.all_keys)

    def __len__(self) -> int:
        return len(self.all_keys)

    def __contains__(self, key: object) -> bool:
        return key in self.state_dict or key in self.index


class AliasedWeights(Mapping):  # type: ignore[type-arg]
    """A weights map where tied parameter names missing from ``base`` read their tied twin's entry."""

    def __init__(self, base: Mapping[str, Any], aliases: Mapping[str, str]) -> None:
        self.base = base
        self.aliases = dict(aliases)

    def __getitem__(self, key: str) -> Any:
        return self.base[key] if key in self.base else self.base[self.aliases[key]]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.base) + [k for k in self.aliases if k not in self.base])

    def __len__(self) -> int:
        return len(list(iter(self)))

    def __contains__(self, key: object) -> bool:
        return key in self.base or key in self.aliases


def extract_submodules_state_dict(state_dict: Mapping[str, torch.Tensor],
                                  submodule_names: list[str]) -> dict[str, torch.Tensor]:
    """The entries of ``state_dict`` that belong to one of ``submodule_names``.

    Example:
        >>> extract_submodules_state_dict({"a.w": 1, "ab.w": 2}, ["a"])
        {'a.w': 1}
    """
    result: dict[str, torch.Tensor] = {}
    for module_name in submodule_names:
        result.update({k: v for k, v in state_dict.items()
                       if module_name == "" or k == module_name or k.startswith(module_name + ".")})
    return result


def load_offloaded_weights(model: nn.Module, index: Mapping[str, Any], offload_folder: str | os.PathLike[str]) -> None:
    """Load every weight listed in ``index`` from ``offload_folder`` into ``model`` (on the CPU).

    Example:
        >>> load_offloaded_weights(model, json.load(open("offload/index.json")), "offload")
    """
    from hasten.big_modeling.tensors import set_module_tensor_to_device

    loader = OffloadedWeightsLoader(save_folder=offload_folder, index=index)
    for name in index:
        set_module_tensor_to_device(model, name, "cpu", value=loader[name].clone())
