"""Checksum and fsync each file of a save in the background, as soon as it is written.

A save writes its files into a staging folder that no load accepts until the manifest is written
and the folder is renamed (see :mod:`hasten.checkpointing.naming`). Inside it, each file therefore
needs no temporary name, rename and folder fsync of its own: it is written under its final name and
handed to the folder's :class:`Sealer`, which computes its CRC-32 at once (the bytes are still in the
page cache) and fsyncs it in a thread while the next file is serialised: fsync mostly waits for the
disk and releases the GIL, so the flush overlaps the CPU work instead of following it. (The CRC stays
on the calling thread: measured on 2 busy cores, a CRC thread slowed serialisation down more than it
saved.)

:func:`hasten.checkpointing.manifest.write_manifest` then uses these results and only reads the files
this process did not write (other ranks' files, DCP's own files).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from hasten.base.serialization import fsync_file

_ACTIVE: dict[Path, Sealer] = {}
_LOCK = threading.Lock()


class Sealer:
    """CRC-32 (inline) and background fsync of the files written into one staging folder."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hasten-fsync")
        self._sealed: dict[str, tuple[int, str]] = {}
        self._syncs: list[Future[None]] = []

    def seal(self, path: Path) -> None:
        """Checksum ``path`` (a finished file under the folder) now and fsync it in the background."""
        from hasten.checkpointing.manifest import file_checksum

        self._sealed[path.relative_to(self.folder).as_posix()] = file_checksum(path)
        self._syncs.append(self._pool.submit(fsync_file, path))

    def finish(self) -> dict[str, tuple[int, str]]:
        """Wait until every sealed file is synced; ``{relative path: (size, crc32 hex)}``.

        Raises:
            OSError: an fsync failed (the save must not be published).
        """
        try:
            for future in self._syncs:
                future.result()
            return dict(self._sealed)
        finally:
            self._pool.shutdown(wait=True)


def start(folder: Path) -> Sealer:
    """Seal the files written under ``folder`` from now on (until :func:`stop`)."""
    sealer = Sealer(folder)
    with _LOCK:
        _ACTIVE[folder] = sealer
    return sealer


def stop(folder: Path) -> None:
    """Stop sealing ``folder`` (its files are written through temporary names again); idempotent."""
    with _LOCK:
        sealer = _ACTIVE.pop(folder, None)
    if sealer is not None:
        sealer._pool.shutdown(wait=True)


def sealer_for(path: Path) -> Sealer | None:
    """The sealer of the staging folder ``path`` is written into, or None (write it atomically)."""
    if not _ACTIVE:
        return None
    with _LOCK:
        for parent in path.parents:
            if parent in _ACTIVE:
                return _ACTIVE[parent]
    return None


__all__ = ["Sealer", "sealer_for", "start", "stop"]
