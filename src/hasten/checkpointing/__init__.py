"""Checkpoint folders (Accelerate's layout), crash-safe writes, weights-only-safe reads."""

from __future__ import annotations

from hasten._lazy import accelerate_path_getattr
from hasten.checkpointing.naming import (
           SAVE_STAGE_HOOKS,
           checkpoints_root,
           complete_checkpoints,
           newest_checkpoint,
           prune,
)
from hasten.checkpointing.rng import CheckpointError, capture_rng_state, restore_rng_state
from hasten.checkpointing.safe_load import add_safe_types
from hasten.checkpointing.shards import write_model_files

__all__ = ["SAVE_STAGE_HOOKS", "CheckpointError", "add_safe_types", "capture_rng_state", "checkpoints_root", "complete_checkpoints",
           "newest_checkpoint", "prune", "restore_rng_state", "write_model_files"]


# Names Accelerate shows at this module path but hasten defines elsewhere (hasten/_accelerate_paths.py).
__getattr__ = accelerate_path_getattr(__name__, globals())
