"""Accelerate's ``accelerate.utils.launch`` path: launcher helpers.

``PrepareForLaunch`` and ``env_var_path_add`` work; the functions that build Accelerate's launcher command
lines and ``ACCELERATE_*`` variables are refused: ``hasten launch`` hands workers one validated
configuration instead (docs/architecture.md, configuration flow)."""

from __future__ import annotations

from hasten._lazy import accelerate_path_getattr

# Every name of this path resolves from hasten/_accelerate_paths.py on first use (one definition each).
__getattr__ = accelerate_path_getattr(__name__, globals())
