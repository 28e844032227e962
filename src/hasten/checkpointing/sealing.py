"""Checksum and fsync each file of a save in the background, as soon as it is written.

A save writes its files into a staging folder that no load accepts until the manifest is written
and the folder is renamed (see :mod:`hasten.checkpointing.naming`). Inside it, each file therefore
needs no temporary name, rename and folder fsync of its own: it is written under its final name and
handed to the save's :class:`Sealer` (made by :class:`hasten.checkpointing.manager.CheckpointManager`
and passed to every writer, ``sealer=``), which computes its CRC-32 at once (the bytes are still in the
page cache) and fsyncs it in a thread while the next file is serialised: fsync mostly waits for the
disk and releases the GIL, so the flush overlaps the CPU work instead of following it. (The CRC stays
on the calling thread: measured on 2 busy cores, a CRC thread slowed serialisation down more than it
saved.)

:func:`hasten.checkpointing.manifest.write_manifest` then uses these results and only reads the files
this process did not write (other ranks' files, DCP's own files).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from hasten.base.serialization import fsync_file


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

    def close(self) -> None:
        """Stop the fsync thread (after :meth:`finish`, or when the save failed); idempotent."""
        self._pool.shutdown(wait=True)


__all__ = ["Sealer"]
