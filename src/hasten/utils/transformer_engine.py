"""Accelerate's ``accelerate.utils.transformer_engine`` path: NVIDIA Transformer Engine, which hasten refuses
(its fp8 engine is torchao; see docs/migrating.md)."""

from __future__ import annotations

from hasten._lazy import accelerate_path_getattr

# Every name of this path resolves from hasten/_accelerate_paths.py on first use (one definition each).
__getattr__ = accelerate_path_getattr(__name__, globals())
