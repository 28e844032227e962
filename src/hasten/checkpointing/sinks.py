"""Where the files of a save go: the sink every writer of a checkpoint file is handed.

A file is written in one of three ways, and the caller chooses it by the sink it passes
(``Strategy.save(..., sink=)``, ``files.torch_save(..., sink=)``); nothing is looked up by path:

- :class:`SealedSink`: a file of a synchronous save's staging folder. The folder is published as a
  whole only after the manifest is written and it is renamed (:mod:`hasten.checkpointing.publication`),
  so each file needs no temporary name, rename and folder fsync of its own: it is written under its
  final name, its CRC-32 is computed at once (the bytes are still in the page cache) and it is fsync'ed
  in a thread while the next file is serialised (fsync mostly waits for the disk and releases the GIL,
  so the flush overlaps the CPU work instead of following it; the CRC stays on the calling thread:
  measured on 2 busy cores, a CRC thread slowed serialisation down more than it saved).
  :func:`hasten.checkpointing.manifest.write_manifest` then uses these results and only reads the
  files this process did not write (other ranks' files, DCP's own files).
- ``SnapshotSink`` (:mod:`hasten.checkpointing.background`): a file of an asynchronous save. Its
  state is only staged now (tensors copied into reused host buffers); the same writer runs later on
  the copy, in the background, so the file holds the same bytes.
- :class:`AtomicSink` (:data:`ATOMIC`): anywhere else (``save_model``, Accelerate's helpers): a
  temporary name, an fsync and a rename.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

from hasten.base.serialization import atomic_path, fsync_file

Writer = Callable[[Any, Path], Any]  # write(state, file): serialises ``state`` into ``file``
# write(state, folder, group): a write every process runs together (DCP's), on ``group`` (None: alone)
CollectiveWriter = Callable[[Any, Path, Any], Any]


class Sink(Protocol):
    """How the files of one save (or one helper call) are written."""

    def write(self, path: Path, write: Writer, state: Any) -> None:
        """Have ``write(state, file)`` produce ``path`` (now, or from a copy of ``state`` later)."""

    def write_together(self, path: Path, write: CollectiveWriter, state: Any) -> None:
        """Have every process run ``write(state, path, group)`` together (a sharded folder)."""


def _default_group() -> Any:
    """The group a write on the calling thread runs on: torch's default one (None when there is none)."""
    import torch.distributed as dist

    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


class AtomicSink:
    """Each file through a temporary name, an fsync and a rename: complete or absent, never half."""

    def write(self, path: Path, write: Writer, state: Any) -> None:
        """Write ``path`` atomically."""
        with atomic_path(path) as tmp:
            write(state, tmp)

    def write_together(self, path: Path, write: CollectiveWriter, state: Any) -> None:
        """Run the collective write now, on torch's default group."""
        write(state, path, _default_group())


ATOMIC = AtomicSink()  # stateless: the one every helper outside a checkpoint's staging folder uses


class SealedSink:
    """The files of one synchronous save's staging folder: written under their final names, CRC-32
    (inline) and fsync (in a thread) as each one is finished."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hasten-fsync")
        self._sealed: dict[str, tuple[int, str]] = {}
        self._syncs: list[Future[None]] = []

    def write(self, path: Path, write: Writer, state: Any) -> None:
        """Write ``path`` (a file of the folder) under its final name, then :meth:`seal` it."""
        write(state, path)
        self.seal(path)

    def write_together(self, path: Path, write: CollectiveWriter, state: Any) -> None:
        """Run the collective write now, on torch's default group (its files are checksummed when the
        save is published, with the other files this process did not write)."""
        write(state, path, _default_group())

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
            self.close()

    def close(self) -> None:
        """Stop the fsync thread (after :meth:`finish`, or when the save failed); idempotent."""
        self._pool.shutdown(wait=True)


__all__ = ["ATOMIC", "AtomicSink", "CollectiveWriter", "SealedSink", "Sink", "Writer"]
