"""Accelerate's ``accelerate.utils.megatron_lm`` path: Megatron-LM, which hasten refuses (see docs/migrating.md)."""

from __future__ import annotations

from hasten._lazy import accelerate_path_getattr

# Every name of this path resolves from hasten/_accelerate_paths.py on first use (one definition each).
__getattr__ = accelerate_path_getattr(__name__, globals())
