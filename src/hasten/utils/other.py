"""Accelerate's ``accelerate.utils.other`` path: ``ThreadLocalSharedDict`` and ``wait_for_everyone``, which
both live in :mod:`hasten.state` (Accelerate's own home for the first).

Part of the ``hasten.utils`` facade: both resolve lazily, on first access, so this bottom-layer module
imports nothing from the state layer.
"""

from __future__ import annotations

from typing import Any

from hasten._lazy import accelerate_path_getattr

_accelerate_path = accelerate_path_getattr(__name__, globals())


def __getattr__(name: str) -> Any:
    if name in ("ThreadLocalSharedDict", "wait_for_everyone"):
        import hasten.state

        return getattr(hasten.state, name)
    return _accelerate_path(name)  # the model helpers hasten keeps in utils.modeling (hasten/_accelerate_paths.py)
