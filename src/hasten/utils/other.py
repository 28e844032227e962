"""Accelerate's ``accelerate.utils.other`` path: ``wait_for_everyone`` lives in :mod:`hasten.state`.

Part of the ``hasten.utils`` facade: the name resolves lazily, on first access.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "wait_for_everyone":
        from hasten.state import wait_for_everyone

        return wait_for_everyone
    raise AttributeError(f"module 'hasten.utils.other' has no attribute {name!r}")
