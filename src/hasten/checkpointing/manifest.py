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
import re
import stat
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hasten.base.serialization import atomic_path, fsync_dir
from hasten.checkpointing.rng import CheckpointError

MANIFEST = "hasten_checkpoint.json"
STAGING_MARKER = ".hasten_staging"
FORMAT = "hasten-checkpoint-1"
_CHUNK = 64 << 20
#: Bounds on a manifest (a genuine one lists a few thousand files at most): bytes, entries, name depth.
MAX_MANIFEST_BYTES = 64 << 20
MAX_ENTRIES = 1_000_000
MAX_NAME_PARTS = 16
#: The most processes a manifest may name (far above any real run; every process writes files it lists).
MAX_PROCESSES = 1 << 20
_CRC = re.compile(r"^[0-9a-f]{8}$")
_RNG_NAME = re.compile(r"^random_states_(\d+)\.pkl$")


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
    while writing them (:class:`hasten.checkpointing.sinks.SealedSink`); the others (other processes' files,
    DCP's) are read here.
    """
    sealed = sealed or {}
    names = [rel for rel in list_files(folder) if rel not in (MANIFEST, STAGING_MARKER)]
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
    # Only now: until the manifest is complete the marker says "hasten's unfinished save", so a kill
    # at any point leaves a folder the next save recognises as its own (issue 28).
    (folder / STAGING_MARKER).unlink(missing_ok=True)
    return manifest


def check_entry_name(rel: Any) -> str:
    """``rel`` if it is a plain relative POSIX name inside the folder (no ``..``, ``.``, absolute path,
    backslash or NUL; at most :data:`MAX_NAME_PARTS` deep); ValueError otherwise."""
    if not isinstance(rel, str) or not rel or len(rel) > 4096 or "\x00" in rel or "\\" in rel or rel.startswith("/"):
        raise ValueError(f"entry {str(rel)[:80]!r} is not a relative file name")
    parts = rel.split("/")
    if len(parts) > MAX_NAME_PARTS or any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"entry {rel[:80]!r} leaves the folder or is not a plain relative name")
    return rel


def _check_manifest(manifest: Any) -> dict[str, Any]:
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"unknown format {manifest.get('format') if isinstance(manifest, dict) else manifest!r:.40}")
    files, count = manifest.get("files"), manifest.get("num_processes")
    if not isinstance(files, dict) or len(files) > MAX_ENTRIES:
        raise ValueError("'files' is not a mapping of at most a million entries")
    _check_process_count(count, files)
    for rel, entry in files.items():
        check_entry_name(rel)
        if rel in (MANIFEST, STAGING_MARKER) or not isinstance(entry, dict) or type(entry.get("size")) is not int \
                or entry["size"] < 0 or not isinstance(entry.get("crc32"), str) or not _CRC.match(entry["crc32"]):
            raise ValueError(f"entry {rel[:80]!r} is not a file record")
    return manifest


def _check_process_count(count: Any, files: dict[str, Any]) -> None:
    """``num_processes`` is an int in ``1..MAX_PROCESSES`` and covers the random-generator files listed
    (every process writes ``random_states_{rank}.pkl``; a machine without the main one's file system holds
    only its own processes' files, so the listed ranks may be a part of ``0..count-1``, never beyond it).

    Checked before anything uses the count: a crafted one would otherwise size lists and messages.
    """
    if type(count) is not int or not 1 <= count <= MAX_PROCESSES:
        raise ValueError(f"field 'num_processes' = {repr(count)[:40]} is not a process count (an integer from 1 to "
                         f"{MAX_PROCESSES})")
    beyond = max((int(m.group(1)) for rel in files if (m := _RNG_NAME.match(rel))), default=-1)
    if beyond >= count:
        raise ValueError(f"field 'num_processes' = {count} does not cover the random generator files it lists "
                         f"(random_states_{beyond}.pkl: each process writes its own)")


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The manifest of ``folder``, validated before anything it lists is read or removed; None for a
    checkpoint written without one (Accelerate, older hasten).

    Raises:
        CheckpointError: the manifest is damaged, too large or too deeply nested, is not a regular file,
            or lists a name outside the folder (crafted).
    """
    path = folder / MANIFEST
    try:
        info = os.lstat(path)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("it is not a regular file (hasten never writes links)")
        if info.st_size > MAX_MANIFEST_BYTES:
            raise ValueError(f"{info.st_size} bytes, more than a manifest ever holds")
        return _check_manifest(json.loads(path.read_text()))
    except RecursionError:
        raise CheckpointError(f"Checkpoint manifest {path} is damaged or crafted (nested too deeply); the "
                              "checkpoint cannot be verified and nothing it lists was read or removed.") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"Checkpoint manifest {path} is damaged or crafted ({exc}); the checkpoint cannot be "
                              "verified and nothing it lists was read or removed. Load another checkpoint.") from exc


def verify_files(folder: Path, manifest: dict[str, Any], names: Iterable[str]) -> None:
    """Check presence, size and CRC-32 of ``names`` (manifest entries) in ``folder``.

    Raises:
        CheckpointError: naming the first file that is missing, has another size or another checksum.
    """
    for rel in names:
        entry = manifest["files"][rel]
        path = folder / rel
        if _symlink_on_the_way(folder, rel):
            raise CheckpointError(f"Checkpoint file {path} is reached through a symbolic link, which hasten never "
                                  "writes: the checkpoint was modified after it was saved. Nothing was loaded.")
        if not path.is_file():
            raise CheckpointError(f"Checkpoint file {path} is missing (the manifest {MANIFEST} lists it): the "
                                  "checkpoint was modified after it was saved. Nothing was loaded.")
        size, crc = file_checksum(path)
        if size != entry["size"] or crc != entry["crc32"]:
            raise CheckpointError(f"Checkpoint file {path} is damaged: its {'size' if size != entry['size'] else 'checksum'}"
                                  f" differs from the one recorded at save time ({size} bytes, crc32 {crc} vs "
                                  f"{entry['size']} bytes, crc32 {entry['crc32']}). Nothing was loaded; restore the "
                                  "file or load another checkpoint.")


def _symlink_on_the_way(folder: Path, rel: str) -> bool:
    current = folder
    for part in rel.split("/"):
        current = current / part
        if current.is_symlink():
            return True
    return False


def my_share(names: list[str], local_rank: int, local_world: int) -> list[str]:
    """The files this process verifies: the node's processes split every file of the folder between them."""
    return names[local_rank::max(local_world, 1)]


__all__ = ["MANIFEST", "STAGING_MARKER", "check_entry_name", "file_checksum", "list_files", "my_share", "read_manifest",
           "verify_files", "write_manifest"]
