"""``save_model``: one weights file, or size-capped shards plus an index, in transformers' layout."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from hasten.base.serialization import atomic_path
from hasten.base.sizes import convert_file_size_to_int
from hasten.checkpointing.files import dedupe_shared_tensors, torch_save

_SHARD_RE = re.compile(r"^(model|pytorch_model)-\d{5}-of-\d{5}\.(safetensors|bin)$")


def split_into_shards(state_dict: Mapping[str, torch.Tensor], max_shard_size: int) -> list[list[str]]:
    """Greedy, in key order: a shard closes before it would exceed ``max_shard_size``; a larger tensor
    gets a shard of its own."""
    shards: list[list[str]] = [[]]
    current = 0
    for name, tensor in state_dict.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and current + size > max_shard_size:
            shards.append([])
            current = 0
        shards[-1].append(name)
        current += size
    return shards


def write_model_files(state_dict: Mapping[str, torch.Tensor], save_directory: str | os.PathLike[str],
                      max_shard_size: int | str = "10GB", safe_serialization: bool = True) -> list[Path]:
    """Write ``state_dict`` into ``save_directory`` as a single file or shards + index; returns the files.

    Shards of an earlier save that this one does not rewrite are removed, so a folder never mixes
    two saves.
    """
    folder = Path(save_directory)
    if folder.is_file():
        raise ValueError(f"save_model: {folder} is a file; pass a folder.")
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in dedupe_shared_tensors(state_dict).items()} \
        if safe_serialization else {k: v.detach().cpu() for k, v in state_dict.items()}
    groups = split_into_shards(tensors, convert_file_size_to_int(max_shard_size))
    stem, ext = ("model", "safetensors") if safe_serialization else ("pytorch_model", "bin")
    if len(groups) == 1:
        names = [f"{stem}.{ext}"]
    else:
        names = [f"{stem}-{i + 1:05d}-of-{len(groups):05d}.{ext}" for i in range(len(groups))]
    _remove_stale(folder, set(names), stem)
    written = []
    for name, keys in zip(names, groups):
        path = folder / name
        _write_shard({k: tensors[k] for k in keys}, path, safe_serialization)
        written.append(path)
    index_path = folder / f"{stem}.{ext}.index.json"
    if len(groups) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {k: name for name, keys in zip(names, groups) for k in keys}}
        with atomic_path(index_path) as tmp:
            tmp.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.append(index_path)
    elif index_path.exists():
        index_path.unlink()
    return written


def _write_shard(tensors: dict[str, torch.Tensor], path: Path, safe: bool) -> None:
    if safe:
        from safetensors.torch import save_file

        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata={"format": "pt"})
    else:
        torch_save(tensors, path)


def _remove_stale(folder: Path, keep: set[str], stem: str) -> None:
    for entry in folder.iterdir():
        if entry.name in keep:
            continue
        if _SHARD_RE.match(entry.name) and entry.name.startswith(stem):
            entry.unlink()
        elif entry.name in (f"{stem}.safetensors", f"{stem}.bin", "pytorch_model.bin"):
            entry.unlink()
