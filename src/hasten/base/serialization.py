"""Crash-safe, durable writes: write to a temporary name in the same folder, fsync it, rename it into
place, fsync the folder. A crash or power loss leaves either the old file or the complete new one."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Flush ``path``'s data to the storage device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the entries of folder ``path`` (creations, renames) durable; a no-op where folders cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # Windows: folders cannot be opened, and NTFS journals renames itself
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a folder; their renames are already ordered
    finally:
        os.close(fd)


@contextmanager
def atomic_path(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``target``; on success it is fsync'ed and replaces ``target`` in one
    rename, and the folder is fsync'ed.

    A crash (or an exception) leaves the previous ``target`` untouched and removes the temporary file;
    a power loss never publishes an empty or partial file under ``target``.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        fsync_file(tmp_path)
        os.replace(tmp_path, target)
        fsync_dir(target.parent)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


def write_atomically(target: str | os.PathLike[str], writer: Callable[[Path], Any]) -> None:
    """Call ``writer(tmp_path)`` then move the result to ``target`` atomically."""
    with atomic_path(target) as tmp:
        writer(tmp)


def save_atomically(obj: Any, f: str | os.PathLike[str], safe_serialization: bool = False) -> None:
    """``torch.save`` (or safetensors for a dict of tensors) through a temporary file and a rename.

    Raises:
        TypeError: ``safe_serialization`` with something other than a dict of tensors.
    """
    import torch

    if safe_serialization:
        from safetensors.torch import save_file

        if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
            raise TypeError("save(..., safe_serialization=True) needs a dict of tensors (a state dict); got "
                            f"{type(obj).__name__}. HINT: use safe_serialization=False for other objects.")
        tensors = {k: v.detach().contiguous() for k, v in obj.items()}
        write_atomically(f, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
    else:
        write_atomically(f, lambda tmp: torch.save(obj, tmp))


def load(f: str | os.PathLike[str], map_location: Any = None, **kwargs: Any) -> Any:
    """Load what :func:`save` wrote; never runs code (``weights_only=True`` unless you pass otherwise)."""
    import torch

    if str(f).endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(str(f), device=str(map_location or "cpu"))
    kwargs.setdefault("weights_only", True)
    return torch.load(f, map_location=map_location, **kwargs)
