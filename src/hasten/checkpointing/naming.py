"""Checkpoint folders' names and rotation: automatic naming, pruning to ``total_limit``, the save stages.

How a save becomes a checkpoint folder (the staging folder, the atomic publication, recovery after a
crash) is :mod:`hasten.checkpointing.publication`. Nothing hasten did not write is deleted or moved
(:mod:`hasten.checkpointing.ownership`). Automatic names are ``{project_dir}/checkpoints/checkpoint_{i}``,
numbered on after the highest one present; only complete folders count when choosing the newest or pruning the oldest, pruning happens
after the new checkpoint is published and never removes it, and a folder being pruned is first renamed
to ``checkpoint_{i}.pruning`` (a name no loader counts), so a kill mid-way leaves nothing that looks
like a checkpoint; the next save finishes the removal.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable
from pathlib import Path

from hasten.base.serialization import fsync_dir
from hasten.checkpointing.manifest import (
    MANIFEST,
)
from hasten.checkpointing.ownership import foreign_entries, remove_owned
from hasten.checkpointing.rng import CheckpointError

#: Test-only instrumentation: callables run as ``hook(stage, folder)`` at the stages of a save:
#: "staged" (staging folder created, nothing written), "before_publish" (every file written),
#: "exchanged" (new checkpoint in place, previous one not yet deleted), "between_renames" (the
#: fallback path without an atomic exchange), "published" (before pruning), "pruning" (a pruned
#: folder renamed, its files not yet deleted).
SAVE_STAGE_HOOKS: list[Callable[[str, Path], None]] = []

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
