"""Asynchronous ``save_state``: a snapshot in host memory now, serialising, writing and publication in the background.

``save_state(..., async_save=True)`` runs the same code as a synchronous save, but hands the writers
a :class:`SnapshotSink` instead of the synchronous save's sealed sink
(:mod:`hasten.checkpointing.sinks`): no file is written; its state is **staged** instead, on the
calling thread: its tensors copied into host
host buffers that are allocated once and reused from save to save
(:mod:`hasten.checkpointing.buffers`), the small rest deep-copied. So the snapshot is consistent with
the training state at the call, and the loop waits only for memory copies. Training then goes on while
a background thread (one per process):

1. serialises each staged state with the same writer a synchronous save uses (safetensors,
   ``torch.save``) straight into its file, so the files are byte for byte those of a synchronous save,
   then CRC-32s and fsyncs it (:class:`hasten.checkpointing.sinks.SealedSink`);
2. tells the other processes it is done (or that it failed) on a process group of its own (gloo),
   so that it never interleaves with the training loop's collectives;
3. once **every** process's files are durable, publishes the folder and prunes old checkpoints with
   the sequence a synchronous save runs (:func:`hasten.checkpointing.publication.publish_agreed`:
   manifest, atomic swap, rotation, the processes agreeing after each step).

Until step 3 the previous checkpoint is untouched, so a crash or ``kill -9`` at any moment leaves it
loadable, never a half one. At most one save is in flight: the next ``save_state``, ``load_state``,
``wait_for_checkpoint`` and ``end_training`` wait for it, and raise its failure (the same message on
every process, naming the process and the file). So does every way out of the process
(:mod:`hasten.checkpointing.at_exit`): a script may end with the save in flight.

Sharded checkpoints (DCP folders, :mod:`hasten.checkpointing.dcp`) are staged the same way: each
process's local shards are copied (DTensors of the same spec over host copies) and
:meth:`SnapshotSink.write_together` keeps them for a write that every process runs together. Before its
own files, the background thread runs those writes (``dcp.save``) in the order the save added them,
on the coordinator's gloo group, and the processes agree after each one: one thread, one order, one
group, so DCP's collectives never interleave with the publication's or the training loop's. Files
DeepSpeed writes itself are written on the calling thread as in a synchronous save; only their
publication is in the background. So is a state that cannot be deep-copied (a rare object): it is
written on the calling thread, then sealed in the background.

Memory: one set of host buffers per :class:`BackgroundSaver` (per Accelerator), the size of the
tensors this process writes (weights, optimizer state, accumulated gradients; for a sharded save its
local shards), kept between saves and freed by ``end_training`` (:meth:`BackgroundSaver.release`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

from hasten.checkpointing import at_exit
from hasten.checkpointing.buffers import HostBuffers
from hasten.checkpointing.naming import run_stage_hooks
from hasten.checkpointing.publication import (
    Publication,
    attempt,
    failure_text,
    first_failure,
    publish_agreed,
    raise_failure,
)
from hasten.checkpointing.sinks import CollectiveWriter, SealedSink, Writer
from hasten.exceptions import CheckpointError

_WRITTEN = object()  # a file already written on the calling thread: only sealed in the background
_WHAT = "The background save"  # the failure's subject (raise_failure)


class SnapshotSink:
    """One process's part of an asynchronous save, the sink its writers are handed: staged states
    waiting to be serialised and written in the background.

    Stage into it only inside :meth:`capturing`.
    """

    def __init__(self, folder: Path, buffers: HostBuffers | None = None) -> None:
        self.folder = folder
        self.buffers = buffers if buffers is not None else HostBuffers()
        self.files: list[tuple[Path, Writer, Any]] = []
        self.collective: list[tuple[Path, CollectiveWriter, Any]] = []

    @contextmanager
    def capturing(self) -> Iterator[SnapshotSink]:
        """The block that stages the save's states; when it ends, copies from devices have completed and
        the buffers this snapshot did not reuse are freed."""
        self.buffers.begin()
        try:
            yield self
        finally:
            self.buffers.end()

    def write(self, path: Path, write: Writer, state: Any) -> None:
        """Stage ``state`` now (tensors copied into the buffers); ``write(staged, path)`` runs later."""
        try:
            staged = self.buffers.stage(state)
        except Exception:  # noqa: BLE001 - cannot be copied (e.g. a tensor with autograd history): write it now
            write(state, path)
            staged = _WRITTEN
        self.files.append((path, write, staged))

    def write_together(self, path: Path, write: CollectiveWriter, state: Any) -> None:
        """Stage ``state`` now (a sharded state dict: local shards copied into the buffers);
        ``write(staged, path, group)`` runs later, on every process, in the order they were added."""
        self.collective.append((path, write, self.buffers.stage(state)))

    def write_collective(self, coordinator: Coordinator,
                         after_folder: Callable[[Path], None] | None = None) -> str | None:
        """Run the collective writes in order on the coordinator's group; None, or the first failure
        (the same on every process: they agree after each folder, so none starts the next one alone).

        Every process must call it, with the same writes added in the same order.
        """
        agreed = None
        try:
            while self.collective and agreed is None:
                path, write, staged = self.collective.pop(0)  # the copy is dropped as soon as it is written
                error = attempt(partial(_write_together, write, staged, path, coordinator.group, after_folder))[1]
                del staged
                agreed = coordinator.first_error(error)
        finally:
            self.collective.clear()
        return agreed

    def write_out(self, after_file: Callable[[Path], None] | None = None) -> dict[str, tuple[int, str]]:
        """Serialise, write, checksum and fsync every file; ``{relative path: (size, crc32 hex)}``.

        Raises:
            CheckpointError: serialising, a write or an fsync failed (names the file).
        """
        sealed = SealedSink(self.folder)
        try:
            # the copies of CUDA storages name their device in these files (and only in these: this thread, now)
            with self.buffers.tagging():
                while self.files:
                    path, write, staged = self.files.pop(0)  # the copy is dropped as soon as it is written
                    if staged is not _WRITTEN:
                        try:
                            write(staged, path)
                        except Exception as exc:
                            raise CheckpointError(f"writing {path} failed: {type(exc).__name__}: {exc}") from exc
                    del staged
                    sealed.seal(path)
                    if after_file is not None:
                        after_file(path)
            try:
                return sealed.finish()
            except OSError as exc:
                raise CheckpointError(f"syncing a file of {self.folder} failed: {exc}") from exc
        finally:
            self.files.clear()
            sealed.close()


def _write_together(write: CollectiveWriter, staged: Any, path: Path, group: Any,
                    after: Callable[[Path], None] | None) -> None:
    try:
        write(staged, path, group)
    except Exception as exc:
        raise CheckpointError(f"writing {path} failed: {failure_text(exc)}") from exc
    if after is not None:
        after(path)


# ------------------------------------------------------------------------------ coordination
class Coordinator:
    """Agreement between the processes' background threads, on a gloo group of their own."""

    def __init__(self, group: Any = None, rank: int = 0) -> None:
        self.group, self.rank = group, rank

    @classmethod
    def create(cls, num_processes: int, rank: int) -> Coordinator:
        """Collective (every process, on the calling thread): a side group for the background threads."""
        import torch.distributed as dist

        if num_processes == 1 or not dist.is_available() or not dist.is_initialized():
            return cls(None, rank)
        return cls(dist.new_group(backend="gloo"), rank)

    def first_error(self, error: str | None) -> str | None:
        """Every process's ``error``: the first one (with its process), the same on every process."""
        if self.group is None:
            return error
        import torch.distributed as dist

        everyone: list[str | None] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, error, group=self.group)
        return first_failure(everyone)


def finish(snapshot: SnapshotSink, pub: Publication, coordinator: Coordinator) -> None:
    """The background part: write and seal, then publish and prune (:func:`publish_agreed`, the
    sequence a synchronous save runs), the processes agreeing on the coordinator's group."""
    def written(path: Path) -> None:
        run_stage_hooks("async_written", path)

    # First the folders every process writes together (DCP's), in the order the save added them, then
    # this process's own files. One thread, one order, one group: collectives never interleave.
    agreed = snapshot.write_collective(coordinator, written)
    if agreed is not None:
        snapshot.files.clear()
        raise_failure(_WHAT, pub, agreed)
    publish_agreed(pub, lambda: snapshot.write_out(written), coordinator.first_error, _WHAT)


class BackgroundSaver:
    """At most one asynchronous save in flight; its failure is kept for the next :meth:`wait`.

    It owns the process's host buffers (:attr:`buffers`, for each :class:`SnapshotSink`), reused by every save.
    """

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self.buffers = HostBuffers()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.publication: Publication | None = None  # of the latest save (for the notice at exit)

    def submit(self, snapshot: SnapshotSink, pub: Publication) -> None:
        """Finish ``snapshot`` in a background thread (call :meth:`wait` first)."""
        assert self._thread is None, "one asynchronous save at a time"

        def run() -> None:
            try:
                finish(snapshot, pub, self.coordinator)
            except BaseException as exc:  # noqa: BLE001 - raised by wait() on the calling thread
                self._error = exc  # the staging folder stays; the next save removes it, no load accepts it

        # Not a daemon, and every way out of the process waits for it first (hasten.checkpointing.at_exit),
        # so a started save is never cut short.
        self.publication = pub
        at_exit.track(self)
        self._thread = threading.Thread(target=run, name="hasten-async-save", daemon=False)
        self._thread.start()

    @property
    def in_flight(self) -> bool:
        """Whether a save is still being written or published."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Wait for the save in flight (if any); raise its failure.

        Raises:
            CheckpointError: the background save failed (the same message on every process).
        """
        if self._thread is not None:
            self._thread.join()
            self._thread = None  # only once joined: the buffers are not released under a running save
        error, self._error = self._error, None
        if error is not None:
            if isinstance(error, CheckpointError):
                raise CheckpointError(str(error)) from error
            raise CheckpointError(f"The background save failed: {type(error).__name__}: {error}") from error

    def release(self) -> None:
        """Wait for the save in flight (raising its failure), then free the host buffers."""
        try:
            self.wait()
        finally:
            if self._thread is None:
                self.buffers.release()


__all__ = ["BackgroundSaver", "CollectiveWriter", "Coordinator", "Publication", "SnapshotSink", "Writer", "finish"]
