"""Checkpoint folders (Accelerate's layout), crash-safe writes, weights-only-safe reads."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from hasten.checkpointing.naming import checkpoints_root, complete_checkpoints, newest_checkpoint, prune
from hasten.checkpointing.rng import CheckpointError, capture_rng_state, restore_rng_state
from hasten.checkpointing.shards import write_model_files

#: Test-only instrumentation: callables run as ``hook(stage, staging_folder)`` during ``save_state``
#: (stage "before_publish" runs after every file is written and before the folder is published).
SAVE_STAGE_HOOKS: list[Callable[[str, Path], None]] = []

__all__ = ["SAVE_STAGE_HOOKS", "CheckpointError", "capture_rng_state", "checkpoints_root", "complete_checkpoints",
           "newest_checkpoint", "prune", "restore_rng_state", "write_model_files"]
