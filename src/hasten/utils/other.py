"""Accelerate's ``accelerate.utils.other`` path: ``ThreadLocalSharedDict`` here, and ``wait_for_everyone``,
which lives in :mod:`hasten.state`.

Part of the ``hasten.utils`` facade: ``wait_for_everyone`` resolves lazily, on first access.
"""

from __future__ import annotations

import threading
from typing import Any


class ThreadLocalSharedDict(threading.local):
    """A dictionary shared by the objects of one thread (Accelerate uses it for per-thread XLA state)."""

    def __init__(self, thread_local: bool = False) -> None:
        self._storage: dict[str, Any] = {}

    def __get__(self, obj: Any, objtype: Any = None) -> dict[str, Any]:
        return self._storage

    def __set__(self, obj: Any, value: dict[str, Any]) -> None:
        self._storage = value


def __getattr__(name: str) -> Any:
    if name == "wait_for_everyone":
        from hasten.state import wait_for_everyone

        return wait_for_everyone
    raise AttributeError(f"module 'hasten.utils.other' has no attribute {name!r}")
