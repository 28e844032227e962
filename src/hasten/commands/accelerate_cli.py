"""Accelerate's ``accelerate.commands.accelerate_cli`` path: ``main`` is the ``hasten`` command line."""

from __future__ import annotations

from hasten._lazy import accelerate_path_getattr
from hasten.commands.main import main

__all__ = ["main"]

# Names Accelerate's module at this path shows but defines elsewhere (hasten/_accelerate_shown.py).
__getattr__ = accelerate_path_getattr(__name__, globals())
