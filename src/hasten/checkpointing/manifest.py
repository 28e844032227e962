"""The checksum manifest of a checkpoint folder: what hasten wrote, how big, and its CRC-32.

``hasten_checkpoint.json`` is written last, after every file of the save is on disk and synced. It
lists every file (relative path, size, CRC-32) and the number of processes that saved. It makes three
things checkable: that the folder is a complete hasten checkpoint, which files in it are hasten's
(everything else is the user's and is never deleted), and that no byte changed since the save.

CRC-32 (``zlib``, ~2.4 GB/s here) detects storage and transfer damage; it is not a signature against
deliberate tampering (crafted files are stopped by :mod:`hasten.checkpointing.safe_load`).
"""

from __future__ import annotations

import json
import mmap
import os
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hasten.checkpointing.rng import CheckpointError
from hasten.utils.serialization import atomic_path, fsync_dir

MANIFEST = "hasten_checkpoint.json"
STAGING_MARKER = ".hasten_staging"
FORMAT = "hasten-checkpoint-1"
_CHUNK = 64 << 20


def file_checksum(path: Path, sync: bool = False) -> tuple[int, str]:
    """``(size, crc32 hex)`` of ``path``; with ``sync`` the file is also fsync'ed (made durable).

    The file is memory-mapped, so the bytes are checksummed where the page cache holds them (no copy).
    """
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        crc = 0
        if size:
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                view = memoryview(mapped)
                try:
                    for start in range(0, size, _CHUNK):
                        crc = zlib.crc32(view[start:start + _CHUNK], crc)
                finally:
                    view.release()
        if sync:
            os.fsync(handle.fileno())
    return size, f"{crc & 0xFFFFFFFF:08x}"


def list_files(folder: Path) -> list[str]:
    """Every regular file under ``folder``, as sorted POSIX relative paths."""
    found = []
    for root, _dirs, names in os.walk(folder):
        for name in names:
            found.append((Path(root) / name).relative_to(folder).as_posix())
    return sorted(found)


def write_manifest(folder: Path, num_processes: int, sealed: dict[str, tuple[int, str]] | None = None) -> dict[str, Any]:
    """Checksum and fsync every file of ``folder`` (and its folders), then write the manifest last.

    ``sealed`` holds ``(size, crc32)`` of the files this process already checksummed and fsync'ed
    while writing them (:mod:`hasten.checkpointing.sealing`); the others (other processes' files,
    DCP's) are read here.
    """
    (folder / STAGING_MARKER).unlink(missing_ok=True)
    sealed = sealed or {}
    names = [rel for rel in list_files(folder) if rel != MANIFEST]
    # A sealed file is reused only while its size still matches what was checksummed.
    todo = [rel for rel in names if rel not in sealed or (folder / rel).stat().st_size != sealed[rel][0]]
    computed = {rel: file_checksum(folder / rel, sync=True) for rel in todo}
    files = {}
    for rel in names:
        size, crc = computed[rel] if rel in computed else sealed[rel]
        files[rel] = {"size": size, "crc32": crc}
    for root, _dirs, _names in os.walk(folder):
        fsync_dir(Path(root))
    manifest = {"format": FORMAT, "num_processes": int(num_processes), "files": files}
    with atomic_path(folder / MANIFEST) as tmp:
        tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The manifest of ``folder``, or None for a checkpoint written without one (Accelerate, older hasten)."""
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
        if manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
            raise ValueError(f"unknown format {manifest.get('format')!r}")
        return manifest
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"Checkpoint manifest {path} is damaged ({exc}); the checkpoint cannot be verified. "
                              "Load another checkpoint.") from exc


def verify_files(folder: Path, manifest: dict[str, Any], names: Iterable[str]) -> None:
    """Check presence, size and CRC-32 of ``names`` (manifest entries) in ``folder``.

    Raises:
        CheckpointError: naming the first file that is missing, has another size or another checksum.
    """
    for rel in names:
        entry = manifest["files"][rel]
        path = folder / rel
        if not path.is_file():
            raise CheckpointError(f"Checkpoint file {path} is missing (the manifest {MANIFEST} lists it): the "
                                  "checkpoint was modified after it was saved. Nothing was loaded.")
        size, crc = file_checksum(path)
        if size != entry["size"] or crc != entry["crc32"]:
            raise CheckpointError(f"Checkpoint file {path} is damaged: its {'size' if size != entry['size'] else 'checksum'}"
                                  f" differs from the one recorded at save time ({size} bytes, crc32 {crc} vs "
                                  f"{entry['size']} bytes, crc32 {entry['crc32']}). Nothing was loaded; restore the "
                                  "file or load another checkpoint.")


def my_share(names: list[str], local_rank: int, local_world: int) -> list[str]:
    """The files this process verifies: the node's processes split every file of the folder between them."""
    return names[local_rank::max(local_world, 1)]


# ----------------------------------------------------------------------------- ownership
_LEGACY_NAMES = ("model", "pytorch_model", "optimizer", "scheduler", "dataloader_state", "scaler", "random_states_",
                 "custom_checkpoint_", "accumulated_gradients", "latest", "zero_to_fp32.py", "zero_to_torch.py",
                 "sampler", MANIFEST, STAGING_MARKER)


def foreign_entries(folder: Path) -> list[str]:
    """What in ``folder`` hasten did not write (empty list: the folder may be replaced or deleted).

    With a manifest, every file it does not list is foreign. Without one (Accelerate's or an older
    hasten's checkpoint), top-level names that no checkpoint writer uses are foreign.
    """
    if not folder.is_dir():
        return []
    manifest = read_manifest(folder) if (folder / MANIFEST).is_file() else None
    if manifest is not None:
        listed = set(manifest["files"]) | {MANIFEST, STAGING_MARKER}
        return [rel for rel in list_files(folder) if rel not in listed]
    return sorted(entry.name for entry in folder.iterdir() if not entry.name.startswith(_LEGACY_NAMES))


__all__ = ["MANIFEST", "STAGING_MARKER", "file_checksum", "foreign_entries", "list_files", "my_share", "read_manifest",
           "verify_files", "write_manifest"]
