"""Accelerate's ``accelerate.utils.bnb`` path: bitsandbytes quantization, which hasten refuses (no engine here;
see docs/migrating.md), and ``has_4bit_bnb_layers``, which works."""

from __future__ import annotations

from hasten._lazy import accelerate_path_getattr

# Every name of this path resolves from hasten/_accelerate_paths.py on first use (one definition each).
__getattr__ = accelerate_path_getattr(__name__, globals())
