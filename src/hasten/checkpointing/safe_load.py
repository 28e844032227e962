"""Loading checkpoint files without ever running code from them.

Every load path of hasten goes through this module:

* plain pickles (DCP's ``.metadata``) are read by :class:`RestrictedUnpickler`, which resolves only
  the exact classes that format needs (:data:`DCP_METADATA_GLOBALS`);
* ``torch.save`` files are read by torch's own ``weights_only`` unpickler, extended per format with
  an allow-list (DeepSpeed's loss scaler and ZeRO enums; NumPy, ``datetime``, ``pathlib``, enums and
  dataclasses for registered objects);
* files another library must read itself with ``weights_only=False`` (DeepSpeed's engine) are first
  checked by a full ``weights_only`` pass over their pickle (memory-mapped, so tensor data is not read).

A file that names anything else is refused with a :class:`CheckpointError` naming the file and the
refused global; nothing in it is called.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import io
import pathlib
import pickle
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

import torch

from hasten.checkpointing.rng import CheckpointError

#: ``(module, name)`` pairs a DCP ``.metadata`` pickle may name (besides torch dtypes).
DCP_METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
})

#: Classes DeepSpeed pickles into its ZeRO optimizer files (plain data holders; resolved lazily).
DEEPSPEED_GLOBALS: tuple[tuple[str, str], ...] = (
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
)


def _is_dtype(module: str, name: str) -> bool:
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


class RestrictedUnpickler(pickle.Unpickler):
    """A pickle reader that resolves only the globals in ``allowed`` (and torch dtypes)."""

    def __init__(self, file: IO[bytes], allowed: frozenset[tuple[str, str]], source: Path) -> None:
        super().__init__(file)
        self._allowed = allowed
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._allowed or _is_dtype(module, name):
            # The allow-list names only torch's own modules, pathlib and collections: importing them
            # (normally already done) runs nothing from the checkpoint.
            owner = sys.modules.get(module)
            if owner is None:
                __import__(module)
                owner = sys.modules[module]
            return getattr(owner, name)
        raise CheckpointError(f"{self._source} refers to {module}.{name}, which a checkpoint of this kind never "
                              "holds; the file was crafted or damaged and was not loaded (nothing in it ran).")


def load_pickle(path: Path, allowed: frozenset[tuple[str, str]] = DCP_METADATA_GLOBALS) -> Any:
    """Unpickle ``path`` with :class:`RestrictedUnpickler`; CheckpointError naming the file on any failure."""
    try:
        with open(path, "rb") as handle:
            return RestrictedUnpickler(handle, allowed, path).load()
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"Checkpoint file {path} is missing.") from None
    except Exception as exc:
        raise CheckpointError(f"Could not read checkpoint file {path}: {exc!r}. It is truncated or corrupted.") from exc


# --------------------------------------------------------------------------- torch.save files
def _resolve(module: str, name: str) -> Any | None:
    """The object ``module.name`` if that module is already imported (never imports anything)."""
    owner = sys.modules.get(module)
    target: Any = owner
    for part in name.split("."):
        target = getattr(target, part, None)
    return target


def _numpy_globals() -> list[Any]:
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    found: list[Any] = [np.ndarray, np.dtype, core.multiarray._reconstruct, core.multiarray.scalar]
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        found += [getattr(dtypes, n) for n in dir(dtypes) if n.endswith("DType")]
    return found


#: Types that registered objects (``register_for_checkpointing``) may hold besides tensors and builtins.
STANDARD_SAFE_TYPES: tuple[Any, ...] = (
    datetime.date, datetime.datetime, datetime.time, datetime.timedelta, datetime.timezone,
    pathlib.Path, pathlib.PosixPath, pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.WindowsPath,
)


def _user_data_class(module: str, name: str) -> Any | None:
    """An Enum or dataclass type already imported by the program (what a registered object may hold)."""
    obj = _resolve(module, name)
    if isinstance(obj, type) and (issubclass(obj, enum.Enum) or dataclasses.is_dataclass(obj)):
        return obj
    return None


def _globals_in(source: Path | bytes) -> list[str]:
    data = io.BytesIO(source) if isinstance(source, bytes) else str(source)
    return list(torch.serialization.get_unsafe_globals_in_checkpoint(data))


def torch_load(source: Path | bytes, name: Path, *, map_location: Any = "cpu", extra: Iterable[Any] = (),
               user_types: bool = False, mmap: bool = False) -> Any:
    """``torch.load(weights_only=True)`` with ``extra`` allowed; ``user_types`` also allows NumPy,
    ``datetime``, ``pathlib`` and the program's own enums and dataclasses.

    ``source`` is a path or the file's bytes; ``name`` is the file named in errors.

    Raises:
        CheckpointError: the file is missing, damaged, or names a type outside the allow-list.
    """
    if isinstance(source, Path) and not source.is_file():
        raise CheckpointError(f"Checkpoint file {name} is missing.")
    allowed = list(extra)
    if user_types:
        allowed += _numpy_globals() + list(STANDARD_SAFE_TYPES)
        try:
            for full in _globals_in(source):
                module, _, attr = full.rpartition(".")
                found = _user_data_class(module, attr)
                if found is not None:
                    allowed.append(found)
        except Exception:  # noqa: BLE001 - the load below reports a damaged file with its name
            pass
    try:
        with torch.serialization.safe_globals(allowed):
            stream: Any = io.BytesIO(source) if isinstance(source, bytes) else source
            return torch.load(stream, map_location=map_location, weights_only=True,
                              mmap=mmap and isinstance(source, Path))
    except Exception as exc:
        text = str(exc)
        if "Unsupported global" in text or "not an allowed global" in text or "GLOBAL" in text:
            refused = text.split("Unsupported global:")[-1].split("was not an allowed global")[0].strip()
            hint = (" Registered objects may hold tensors, builtins, NumPy values, datetime, pathlib, enums and "
                    "dataclasses; make state_dict() return those.") if user_types else ""
            raise CheckpointError(
                f"Checkpoint file {name} holds a type outside the allow-list for this kind of file "
                f"({refused[:200]}); it was not loaded and nothing in it ran.{hint}") from None
        raise CheckpointError(f"Could not read checkpoint file {name}: {exc}. It is truncated or corrupted.") from exc


def deepspeed_globals() -> list[Any]:
    """DeepSpeed's checkpoint classes that are importable here (DeepSpeed is already imported when used)."""
    found = []
    for module, name in DEEPSPEED_GLOBALS:
        obj = _resolve(module, name)
        if obj is not None and isinstance(obj, type):
            found.append(obj)
    return found


def check_deepspeed_files(files: Iterable[Path]) -> None:
    """Refuse (before DeepSpeed reads them with ``weights_only=False``) any file naming other globals."""
    extra = deepspeed_globals()
    for path in files:
        torch_load(path, path, extra=extra, mmap=True)


# ------------------------------------------------------------------------------------- DCP
def dcp_reader(path: Path) -> Any:
    """A ``FileSystemReader`` for ``path`` whose metadata is read by :func:`load_pickle`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = load_pickle(Path(path) / ".metadata")
            check_storage_paths(metadata, Path(path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(str(path))


def check_storage_paths(metadata: Any, folder: Path) -> None:
    """Refuse metadata whose shards lie outside ``folder`` (``../``, absolute paths)."""
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        relative = str(getattr(info, "relative_path", ""))
        parts = Path(relative).parts
        if Path(relative).is_absolute() or ".." in parts:
            raise CheckpointError(f"{folder / '.metadata'} points outside its folder ({relative!r}); the file was "
                                  "crafted or damaged and was not used.")


def dcp_planner(path: Path) -> Any:
    """A ``DefaultLoadPlanner`` that reads DCP's non-tensor items with ``weights_only=True``."""
    from torch.distributed.checkpoint import default_planner

    class SafeLoadPlanner(default_planner.DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            item = torch_load(value.getvalue(), Path(path) / f"<item {read_item.dest_index.fqn}>")
            # Hand DCP the value already read safely (re-serialised: it holds only allowed types now),
            # so its own placement logic (flattened keys) runs unchanged on harmless bytes.
            checked = io.BytesIO()
            torch.save(item, checked)
            checked.seek(0)
            super().load_bytes(read_item, checked)

    return SafeLoadPlanner()


__all__ = ["DCP_METADATA_GLOBALS", "RestrictedUnpickler", "STANDARD_SAFE_TYPES", "check_deepspeed_files", "check_storage_paths", "dcp_planner",
           "dcp_reader", "deepspeed_globals", "load_pickle", "torch_load"]
