"""Checkpoint folders: automatic naming, pruning to ``total_limit``, and crash-safe publication.

A save is written into ``<folder>.tmp`` and renamed to ``<folder>`` only when every process has
finished, so a crash mid-save never produces a folder that looks complete, and never touches the
previous checkpoint. Automatic names are ``{project_dir}/checkpoints/checkpoint_{i}``; only complete
folders count when choosing the newest or pruning the oldest.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from hasten.checkpointing.rng import CheckpointError

TMP_SUFFIX = ".tmp"
OLD_SUFFIX = ".old"
_CHECKPOINT_RE = re.compile(r"^checkpoint_(\d+)$")


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


def prune(root: Path, total_limit: int | None, keep_room_for_one: bool = True) -> list[Path]:
    """Delete the oldest complete checkpoints so that, after one more save, at most ``total_limit`` remain."""
    if total_limit is None:
        return []
    found = complete_checkpoints(root)
    excess = len(found) + (1 if keep_room_for_one else 0) - total_limit
    removed = []
    for _, path in found[: max(excess, 0)]:
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def staging_folder(target: Path) -> Path:
    """Where a save into ``target`` is written before it is published."""
    return target.with_name(target.name + TMP_SUFFIX)


def prepare_staging(target: Path) -> Path:
    """Create an empty staging folder (a leftover from a crashed save is discarded)."""
    staging = staging_folder(target)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def publish(target: Path) -> None:
    """Atomically move the finished staging folder to ``target`` (replacing an older ``target``).

    Called by one process per file system after every process finished writing. A missing staging
    folder means another process on the same file system already published it.
    """
    staging = staging_folder(target)
    if not staging.exists():
        return
    old = target.with_name(target.name + OLD_SUFFIX)
    if target.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(target, old)
    os.replace(staging, target)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)
