"""Loading checkpoint files without ever running code from them.

Every load path of hasten goes through this module:

* plain pickles (DCP's ``.metadata``) are read by :class:`RestrictedUnpickler`, which resolves only
  the exact classes that format needs (:data:`DCP_METADATA_GLOBALS`);
* ``torch.save`` files are read by torch's own ``weights_only`` unpickler, extended per file kind with
  an exact allow-list: NumPy's array and scalar rebuilders for random states (Accelerate pickles
  NumPy's generator state); NumPy, ``datetime`` and ``pathlib`` plus the types the program registered
  with :func:`add_safe_types` for registered objects; DeepSpeed's loss scaler and ZeRO enums for its
  files. No other class of the program is ever resolved, so no constructor, ``__post_init__``,
  ``_missing_`` or ``__setstate__`` of it runs;
* files another library must read itself with ``weights_only=False`` (DeepSpeed's engine) are first
  checked by a full ``weights_only`` pass over their pickle (memory-mapped, so tensor data is not read).

A file that names anything else is refused with a :class:`CheckpointError` naming the file and the
refused global; nothing in it is called.
"""

from __future__ import annotations

import datetime
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


#: The user's own classes allowed in registered objects' files (:func:`add_safe_types`).
_REGISTERED_TYPES: dict[str, type] = {}


def add_safe_types(*types: type) -> None:
    """Allow instances of ``types`` (your own enums, dataclasses...) in registered objects' checkpoint files.

    ``load_state`` never constructs a class it was not told to trust: a file naming any other class is
    refused before anything in it runs. Registering a class means trusting its constructor and hooks
    (``__post_init__``, ``_missing_``, ``__setstate__``) with data from the checkpoint, as
    ``torch.serialization.add_safe_globals`` does for ``torch.load``. Call it before ``load_state``::

        hasten.checkpointing.add_safe_types(TrainPhase, BestScore)

    Raises:
        TypeError: something other than a class was passed.
    """
    for item in types:
        if not isinstance(item, type):
            raise TypeError(f"add_safe_types: {item!r} is not a class; pass the classes themselves.")
        _REGISTERED_TYPES[f"{item.__module__}.{item.__qualname__}"] = item


def registered_types() -> list[type]:
    """The classes allowed by :func:`add_safe_types` so far."""
    return list(_REGISTERED_TYPES.values())


#: What each kind of ``torch.save`` file may name besides torch's own weights-only globals.
KINDS = ("plain", "rng", "registered")


def _allowed_for(kind: str) -> list[Any]:
    if kind == "plain":
        return []
    if kind == "rng":  # Accelerate's random_states_*.pkl hold NumPy's generator state tuple
        return _numpy_globals()
    if kind == "registered":
        return _numpy_globals() + list(STANDARD_SAFE_TYPES) + registered_types()
    raise ValueError(f"unknown checkpoint file kind {kind!r}; one of {KINDS}")


def torch_load(source: Path | bytes, name: Path, *, map_location: Any = "cpu", extra: Iterable[Any] = (),
               kind: str = "plain", mmap: bool = False, user_types: bool = False) -> Any:
    """``torch.load(weights_only=True)`` with the allow-list of ``kind`` (:data:`KINDS`) and ``extra``.

    ``source`` is a path or the file's bytes; ``name`` is the file named in errors. ``user_types=True``
    is the former spelling of ``kind="registered"``.

    Raises:
        CheckpointError: the file is missing, damaged, or names a type outside the allow-list.
    """
    if isinstance(source, Path) and not source.is_file():
        raise CheckpointError(f"Checkpoint file {name} is missing.")
    allowed = list(extra) + _allowed_for("registered" if user_types else kind)
    try:
        with torch.serialization.safe_globals(allowed):
            stream: Any = io.BytesIO(source) if isinstance(source, bytes) else source
            return torch.load(stream, map_location=map_location, weights_only=True,
                              mmap=mmap and isinstance(source, Path))
    except Exception as exc:
        text = str(exc)
        if "Unsupported global" in text or "not an allowed global" in text or "GLOBAL" in text:
            refused = text.split("Unsupported global:")[-1].split("was not an allowed global")[0].strip()
            refused = refused.split("\n")[0].removeprefix("GLOBAL").strip()
            hint = (" Registered objects may hold tensors, builtins, NumPy values, datetime and pathlib; to allow "
                    "a class of your own, trust it explicitly with hasten.checkpointing.add_safe_types(<class>) "
                    "before load_state.") if kind == "registered" or user_types else ""
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


def check_deepspeed_files(files: Iterable[Path]) -> dict[Path, Any]:
    """Refuse (before DeepSpeed reads them with ``weights_only=False``) any file naming other globals.

    Returns what each file holds (tensors memory-mapped, not read), for the checks against the model.
    """
    extra = deepspeed_globals()
    return {path: torch_load(path, path, extra=extra, mmap=True) for path in files}


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


__all__ = ["DCP_METADATA_GLOBALS", "KINDS", "RestrictedUnpickler", "STANDARD_SAFE_TYPES", "add_safe_types", "check_deepspeed_files", "check_storage_paths", "dcp_planner",
           "dcp_reader", "deepspeed_globals", "load_pickle", "registered_types", "torch_load"]
