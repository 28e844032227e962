"""Accelerate's ``accelerate.utils.ao`` path: torchao float8 helpers (defined in :mod:`hasten.base.fp8`)."""

from __future__ import annotations

from hasten._lazy import accelerate_path_getattr

# Every name of this path resolves from hasten/_accelerate_paths.py on first use (one definition each).
__getattr__ = accelerate_path_getattr(__name__, globals())
