"""Miscellaneous helpers exported from ``hasten.utils``."""

from __future__ import annotations

import threading
from typing import Any


def wait_for_everyone() -> None:
    """Barrier across all processes (a no-op with one process)."""
    from hasten.state import PartialState

    PartialState().wait_for_everyone()


class ThreadLocalSharedDict(threading.local):
    """A dictionary shared by the objects of one thread (Accelerate uses it for per-thread XLA state)."""

    def __init__(self, thread_local: bool = False) -> None:
        self._storage: dict[str, Any] = {}

    def __get__(self, obj: Any, objtype: Any = None) -> dict[str, Any]:
        return self._storage

    def __set__(self, obj: Any, value: dict[str, Any]) -> None:
        self._storage = value
