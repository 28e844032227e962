"""How a save becomes a checkpoint folder: the staging folder, the atomic publication and recovery, and the
one publication sequence of a save with its one agreement rule.

A save is written into ``<folder>.tmp`` (:func:`prepare_staging`) and published when every process has
finished (:func:`publish`): its files are checksummed and fsync'ed, the manifest is written last, and one
atomic rename (an exchange, on Linux, when an earlier checkpoint has the name) makes it ``<folder>``. A
crash at any point leaves either the previous checkpoint or the new one under the name, never neither
(:func:`recover` puts back one left as ``<name>.old``). A target holding files hasten did not write is
refused (:func:`check_target`).

Synchronous and asynchronous saves end the same way (:func:`publish_agreed`): this process's files
are written and made durable, then the main process publishes the folder, then each machine's first
process publishes its own copy (file systems the main process does not see), then the main process
prunes to ``total_limit``. After each step **every process agrees** on the outcome: a failure on any
process (writing, sealing, publishing, pruning) stops the sequence on every process and is raised on
every process with the same message, naming the process that failed first. Until the main process
publishes, the previous checkpoint is untouched; publishing itself swaps folders atomically
(:func:`publish`), so a failure leaves a complete checkpoint under the name.

The two saves differ only in how they agree and on which thread: a synchronous save agrees on the
calling thread over the default process group (:func:`agree_on_default_group`); the background thread
of an asynchronous save agrees on a gloo group of its own
(:meth:`hasten.checkpointing.background.Coordinator.first_error`), so it never interleaves with the
training loop's collectives.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hasten.base.serialization import fsync_dir
from hasten.checkpointing.manifest import MANIFEST, STAGING_MARKER, read_manifest, write_manifest
from hasten.checkpointing.naming import prune, run_stage_hooks
from hasten.checkpointing.ownership import foreign_entries, owned_files, remove_owned
from hasten.exceptions import CheckpointError

TMP_SUFFIX = ".tmp"
OLD_SUFFIX = ".old"

#: ``agree(error)``: every process passes its error (None: it succeeded) and gets the first failure,
#: ``"process <rank>: <error>"`` (the bare error with one process), or None; the same on every process.
Agree = Callable[[str | None], str | None]

#: What a failure left behind, by the step that failed (the phrase the raised error carries).
_NOTHING_PUBLISHED = "nothing was published; the previous checkpoint is intact"
_PUBLISHING = "publishing did not finish; the folder holds a complete checkpoint, the previous one or the new one"
_PUBLISHED = "it was published"


@dataclass
class Publication:
    """What publishing a save needs (plain values: a background thread never touches the Accelerator)."""

    target: Path
    staging: Path
    num_processes: int
    is_main: bool
    is_local_main: bool
    prune_limit: int | None  # automatic naming: prune beyond this many (None: no pruning)
    automatic: bool


def attempt(step: Callable[[], Any]) -> tuple[Any, str | None]:
    """``step()``'s result and None, or None and its failure as the text the processes agree on."""
    try:
        return step(), None
    except Exception as exc:  # noqa: BLE001 - agreed with the other processes, then raised on every one
        return None, failure_text(exc)


def failure_text(exc: BaseException) -> str:
    """The text of a failure shared with the other processes (a CheckpointError's own message)."""
    return str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"


def first_failure(errors: list[str | None]) -> str | None:
    """The first process's failure among every process's ``errors`` (in rank order), naming it."""
    if len(errors) == 1:
        return errors[0]
    for rank, message in enumerate(errors):
        if message is not None:
            return f"process {rank}: {message}"
    return None


def agree_on_default_group(num_processes: int) -> Agree:
    """:data:`Agree` over torch's default process group (the calling thread's collectives)."""
    def agree(error: str | None) -> str | None:
        if num_processes == 1:
            return error
        from hasten.ops.collectives import gather_object

        return first_failure(list(gather_object([error])))

    return agree


def raise_failure(what: str, pub: Publication, agreed: str, state: str = _NOTHING_PUBLISHED) -> None:
    """Raise the agreed failure of the save of ``pub`` (the same message on every process).

    Raises:
        CheckpointError: always, ``"<what> of <target> failed (<what it left>): <agreed>"``.
    """
    raise CheckpointError(f"{what} of {pub.target} failed ({state}): {agreed}")


def publish_agreed(pub: Publication, write: Callable[[], dict[str, tuple[int, str]] | None], agree: Agree,
                   what: str) -> None:
    """Write this process's files, then publish and prune, every process agreeing after each step.

    Every process calls it, whatever its role: each takes part in every agreement.

    Args:
        pub: the save to publish.
        write: writes and seals this process's files; returns ``{relative path: (size, crc32)}`` of
            the files it sealed (see :func:`hasten.checkpointing.manifest.write_manifest`).
        agree: how the processes agree (see :data:`Agree`).
        what: the save's name in the error (``"The save"``, ``"The background save"``).

    Raises:
        CheckpointError: a step failed on some process: the same message on every process, naming
            that process, the cause and what the failure left behind.
    """
    sealed, error = attempt(write)
    if error is None:
        _, error = attempt(lambda: run_stage_hooks("before_publish", pub.staging))
    agreed = agree(error)
    if agreed is not None:
        raise_failure(what, pub, agreed)
    steps: list[tuple[bool, Callable[[], Any], str]] = [
        (pub.is_main, lambda: publish(pub.target, pub.num_processes, sealed), _PUBLISHING),
        # machines that do not share the main process's file system publish their own copy
        (pub.is_local_main and not pub.is_main, lambda: publish(pub.target, pub.num_processes, sealed), _PUBLISHED),
        (pub.is_main and pub.automatic, lambda: _rotate(pub), _PUBLISHED),
    ]
    for mine, step, left in steps:
        agreed = agree(attempt(step)[1] if mine else None)
        if agreed is not None:
            raise_failure(what, pub, agreed, left)


def _rotate(pub: Publication) -> None:
    run_stage_hooks("published", pub.target)
    prune(pub.target.parent, pub.prune_limit, keep=pub.target)  # only now: never zero checkpoints


__all__ = ["Agree", "Publication", "agree_on_default_group", "attempt", "failure_text", "first_failure",
           "publish_agreed", "raise_failure"]


# ------------------------------------------------------- the staging folder and the atomic publication
def writes_in_place(target: Path) -> bool:
    """A target that is (or holds) the working directory cannot be renamed: it is written in place."""
    cwd = Path.cwd().resolve()
    resolved = target.resolve()
    return cwd == resolved or resolved in cwd.parents


def staging_folder(target: Path) -> Path:
    """Where a save into ``target`` is written before it is published."""
    if writes_in_place(target):
        return target / (".hasten_staging" + TMP_SUFFIX)
    return target.with_name(target.name + TMP_SUFFIX)


def check_target(target: Path) -> None:
    """Refuse a target whose replacement would lose something hasten did not write.

    Raises:
        CheckpointError: ``target`` is a file, or a folder holding files that are not a hasten
            checkpoint's, naming them and the fix.
    """
    if target.exists() and not target.is_dir():
        raise CheckpointError(f"save_state: {target} is a file, not a checkpoint folder; hasten does not replace it. "
                              "Pass another path, or move the file away.")
    old = target.with_name(target.name + OLD_SUFFIX) if target.name else None
    if old is not None and old.exists() and (not old.is_dir() or foreign_entries(old)):
        raise CheckpointError(f"save_state: {old} exists and is not a hasten checkpoint; hasten may need that name "
                              "while it replaces the checkpoint. Rename or move it.")
    foreign = foreign_entries(target)
    if writes_in_place(target):
        foreign = [f for f in foreign if not f.startswith(".hasten_staging")]
    if foreign:
        raise CheckpointError(f"save_state: {target} already holds files that are not part of a hasten checkpoint "
                              f"({', '.join(foreign[:5])}{' ...' if len(foreign) > 5 else ''}); saving there would "
                              "replace the folder and lose them. Save into a new or empty folder (for example "
                              f"{target / 'checkpoint'}), or move those files away.")


def prepare_staging(target: Path) -> Path:
    """Create an empty staging folder marked as hasten's (a leftover from a crashed save is discarded)."""
    recover(target)
    staging = staging_folder(target)
    if staging.exists():
        # Ours when it carries the staging marker (a killed save; it may hold half-written temporary
        # files) or holds only checkpoint files (a previous checkpoint swapped out before deletion).
        marked = staging.is_dir() and not staging.is_symlink() and (staging / STAGING_MARKER).is_file()
        foreign = [] if marked else foreign_entries(staging) if staging.is_dir() else [staging.name]
        if staging.is_symlink():
            foreign = [staging.name]
        if foreign:
            raise CheckpointError(f"save_state: {staging} exists and holds files hasten did not write "
                                  f"({foreign[:5]}); hasten stages the save there. Move it away.")
        if marked:
            shutil.rmtree(staging)  # our own unfinished save (rmtree never follows a link)
        elif remove_owned(staging):
            raise CheckpointError(f"save_state: could not clear {staging}; move it away.")
    staging.mkdir(parents=True)
    (staging / STAGING_MARKER).touch()
    return staging


def _exchange(first: Path, second: Path) -> bool:
    """Atomically swap two paths (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(first), at_fdcwd, os.fsencode(second), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(first))


def publish(target: Path, num_processes: int, sealed: dict[str, tuple[int, str]] | None = None) -> None:
    """Checksum, sync and write the manifest of the finished staging folder, then make it ``target``.

    An earlier checkpoint under ``target`` is swapped out in one atomic exchange where the system
    offers one (Linux); elsewhere it is renamed to ``<name>.old`` first and :func:`recover` restores
    it if the process dies between the two renames. Called by one process per file system after every
    process finished writing; a missing staging folder means another process already published it.
    ``sealed``: the files this process already checksummed and synced (see :func:`write_manifest`).
    """
    staging = staging_folder(target)
    if not staging.exists():
        return
    write_manifest(staging, num_processes, sealed)
    if writes_in_place(target):
        _publish_in_place(staging, target)
        return
    if target.exists():
        if _exchange(staging, target):
            fsync_dir(target.parent)
            run_stage_hooks("exchanged", target)
            _discard(staging)  # the previous checkpoint, now under the staging name
            return
        old = target.with_name(target.name + OLD_SUFFIX)
        if old.exists() and remove_owned(old):
            raise CheckpointError(f"save_state: {old} holds files hasten did not write; move it away.")
        os.replace(target, old)
        run_stage_hooks("between_renames", target)
        os.replace(staging, target)
        fsync_dir(target.parent)
        _discard(old)
        return
    os.replace(staging, target)
    fsync_dir(target.parent)


def _discard(folder: Path) -> None:
    """Remove a replaced checkpoint (only what hasten wrote; anything else stays, with a warning)."""
    kept = remove_owned(folder)
    if kept:
        warnings.warn(f"save_state: kept {folder} because it holds files hasten did not write: {kept[:5]}",
                      stacklevel=3)


def _publish_in_place(staging: Path, target: Path) -> None:
    """Move the staged entries into ``target`` itself (the working directory); the manifest moves last.

    While this runs the folder holds the staging marker, so a crash leaves a folder that loads refuse.
    """
    previous = owned_files(target)  # validated manifest (or exact legacy names); manifest last
    (target / STAGING_MARKER).touch()
    for rel in [MANIFEST] + [r for r in previous if r not in (MANIFEST, STAGING_MARKER)]:
        (target / rel).unlink(missing_ok=True)  # regular files reached without a link: only hasten's
    for rel in sorted({p for r in previous for p in _parents(r)}, key=lambda r: r.count("/"), reverse=True):
        try:
            os.rmdir(target / rel)
        except OSError:
            continue
    for entry in sorted(staging.iterdir()):
        if entry.name in (MANIFEST, STAGING_MARKER):
            continue
        os.replace(entry, target / entry.name)  # a folder replaces only an empty one (never rmtree here)
    os.replace(staging / MANIFEST, target / MANIFEST)
    staging.rmdir()
    (target / STAGING_MARKER).unlink(missing_ok=True)
    fsync_dir(target)


def _parents(rel: str) -> list[str]:
    parts = rel.split("/")[:-1]
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def recover(target: Path) -> None:
    """Put back a checkpoint left as ``<name>.old`` by a crash between the two renames of :func:`publish`."""
    old = target.with_name(target.name + OLD_SUFFIX)
    if not target.exists() and old.is_dir() and read_manifest(old) is not None:
        try:
            os.replace(old, target)
        except FileNotFoundError:
            return  # another process recovered it first
        fsync_dir(target.parent)


def is_incomplete(folder: Path) -> bool:
    """True for a staging folder, or an in-place save that did not finish."""
    return (folder / STAGING_MARKER).exists()
