"""Checkpoint folders: automatic naming, pruning to ``total_limit``, and crash-safe publication.

A save is written into ``<folder>.tmp`` and published when every process has finished: its files are
checksummed and fsync'ed, the manifest is written last, and one atomic rename (an exchange, on Linux,
when an earlier checkpoint has the name) makes it ``<folder>``. A crash at any point leaves either the
previous checkpoint or the new one under the name, never neither. Nothing hasten did not write is
deleted or moved (:mod:`hasten.checkpointing.ownership`): a target holding other files is refused.
Automatic names are ``{project_dir}/checkpoints/checkpoint_{i}``, numbered on after the highest one
present; only complete folders count when choosing the newest or pruning the oldest, pruning happens
after the new checkpoint is published and never removes it, and a folder being pruned is first renamed
to ``checkpoint_{i}.pruning`` (a name no loader counts), so a kill mid-way leaves nothing that looks
like a checkpoint; the next save finishes the removal.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

from hasten.base.serialization import fsync_dir
from hasten.checkpointing.manifest import (
    MANIFEST,
    STAGING_MARKER,
    read_manifest,
    write_manifest,
)
from hasten.checkpointing.ownership import foreign_entries, owned_files, remove_owned
from hasten.checkpointing.rng import CheckpointError

#: Test-only instrumentation: callables run as ``hook(stage, folder)`` at the stages of a save:
#: "staged" (staging folder created, nothing written), "before_publish" (every file written),
#: "exchanged" (new checkpoint in place, previous one not yet deleted), "between_renames" (the
#: fallback path without an atomic exchange), "published" (before pruning), "pruning" (a pruned
#: folder renamed, its files not yet deleted).
SAVE_STAGE_HOOKS: list[Callable[[str, Path], None]] = []

TMP_SUFFIX = ".tmp"
OLD_SUFFIX = ".old"
PRUNING_SUFFIX = ".pruning"
_CHECKPOINT_RE = re.compile(r"^checkpoint_(\d+)$")
_PRUNING_RE = re.compile(r"^checkpoint_\d+\.pruning$")


def checkpoints_root(project_dir: str | os.PathLike[str] | None) -> Path:
    """``{project_dir}/checkpoints``.

    Raises:
        CheckpointError: no project folder is configured.
    """
    if project_dir is None:
        raise CheckpointError("automatic_checkpoint_naming needs a project folder: pass "
                              "`Accelerator(project_dir=...)` or `ProjectConfiguration(project_dir=...)`.")
    return Path(project_dir) / "checkpoints"


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete ``checkpoint_{i}`` folders under ``root``, oldest first (temporary folders ignored)."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _CHECKPOINT_RE.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def newest_checkpoint(project_dir: str | os.PathLike[str] | None) -> Path | None:
    """The newest complete automatic checkpoint, or None when there is none yet."""
    found = complete_checkpoints(checkpoints_root(project_dir))
    return found[-1][1] if found else None


def iteration_of(folder: Path) -> int | None:
    """The ``i`` of a ``checkpoint_{i}`` folder name (None for other names)."""
    match = _CHECKPOINT_RE.match(folder.name)
    return int(match.group(1)) if match else None


def run_stage_hooks(stage: str, folder: Path) -> None:
    """Run the test instrumentation registered in :data:`SAVE_STAGE_HOOKS`."""
    for hook in SAVE_STAGE_HOOKS:
        hook(stage, folder)


def next_iteration(project_dir: str | os.PathLike[str] | None, iteration: int) -> int:
    """``iteration``, or one past the highest ``checkpoint_{i}`` already present if that is higher.

    A fresh run in a project that holds ``checkpoint_5`` continues at 6, so that its checkpoints are
    the newest ones (and pruning never takes them for old ones).
    """
    found = complete_checkpoints(checkpoints_root(project_dir))
    return max(iteration, found[-1][0] + 1) if found else iteration


def clear_pruning_leftovers(root: Path) -> None:
    """Finish removing folders a killed prune had renamed to ``checkpoint_{i}.pruning``."""
    if not root.is_dir():
        return
    for entry in root.iterdir():
        if _PRUNING_RE.match(entry.name) and entry.is_dir() and not entry.is_symlink():
            kept = remove_owned(entry)
            if kept:
                warnings.warn(f"total_limit: kept {entry} because it holds files hasten did not write: {kept[:5]}",
                              stacklevel=3)


def prune(root: Path, total_limit: int | None, keep: Path | None = None) -> list[Path]:
    """After a save is published: delete the oldest complete checkpoints beyond ``total_limit``.

    The newest checkpoint and ``keep`` (the one just written) are always kept, and so is a folder
    holding files hasten did not write, or a symbolic link (with a warning). Each folder is first
    renamed to ``checkpoint_{i}.pruning`` (atomic: loaders no longer count it), then its files removed.
    """
    clear_pruning_leftovers(root)
    if total_limit is None:
        return []
    found = [item for item in complete_checkpoints(root) if keep is None or item[1] != keep]
    newest = len(found) if keep is not None else len(found) - 1  # keep (the new one) counts towards the limit
    excess = min(len(found) + (keep is not None) - max(total_limit, 1), newest)
    removed = []
    for _, path in found[: max(excess, 0)]:
        foreign = [path.name] if path.is_symlink() else _foreign_or_unverifiable(path)
        if foreign:
            warnings.warn(f"total_limit: kept {path} because it holds files hasten did not write: {foreign[:5]}",
                          stacklevel=3)
            continue
        doomed = path.with_name(path.name + PRUNING_SUFFIX)
        os.replace(path, doomed)
        fsync_dir(root)
        run_stage_hooks("pruning", doomed)
        kept = remove_owned(doomed)
        if kept:
            warnings.warn(f"total_limit: kept {doomed} because it holds files hasten did not write: {kept[:5]}",
                          stacklevel=3)
        removed.append(path)
    if removed:
        fsync_dir(root)
    return removed


def _foreign_or_unverifiable(folder: Path) -> list[str]:
    """:func:`foreign_entries`, with a damaged or crafted manifest counted as foreign (pruning runs on
    the main process only, after publishing: it must keep such a folder, not raise)."""
    try:
        return foreign_entries(folder)
    except CheckpointError as exc:
        return [f"{MANIFEST} ({exc})"]


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
