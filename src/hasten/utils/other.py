"""Accelerate's ``accelerate.utils.other`` path: ``ThreadLocalSharedDict`` here, and ``wait_for_everyone``,
which lives in :mod:`hasten.state`.

Part of the ``hasten.utils`` facade: ``wait_for_everyone`` resolves lazily, on first access.
"""

from __future__ import annotations

import threading
from typing import Any

from hasten._lazy import accelerate_path_getattr


class ThreadLocalSharedDict(threading.local):
    """A dictionary shared by the objects of one thread (Accelerate uses it for per-thread XLA state)."""

    def __init__(self, thread_local: bool = False) -> None:
        self._storage: dict[str, Any] = {}

    def __get__(self, obj: Any, objtype: Any = None) -> dict[str, Any]:
        return self._storage

    def __set__(self, obj: Any, value: dict[str, Any]) -> None:
        self._storage = value


# wait_for_everyone (hasten.state) and the model helpers hasten keeps in utils.modeling resolve on first use
# from hasten/_accelerate_paths.py.
__getattr__ = accelerate_path_getattr(__name__, globals())
