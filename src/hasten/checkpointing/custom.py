"""Accelerate's ``save_custom_state`` (its writing half) and ``load_custom_state``: one registered object's
``state_dict`` per file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hasten.checkpointing.files import load_registered_state, torch_save


def _custom_file(path: str | os.PathLike[str], index: int) -> Path:
    return Path(path) / f"custom_checkpoint_{index}.pkl"


def write_custom_state(obj: Any, path: str | os.PathLike[str], index: int = 0) -> None:
    """Write ``obj.state_dict()`` to ``path/custom_checkpoint_{index}.pkl``, crash-safely (the caller decides
    which process writes: ``hasten.utils.save_custom_state``)."""
    torch_save(obj.state_dict(), _custom_file(path, index))


def load_custom_state(obj: Any, path: str | os.PathLike[str], index: int = 0) -> None:
    """Load what :func:`save_custom_state` wrote into ``obj`` (``obj.load_state_dict``); the file may hold
    what a registered object's may (:func:`hasten.checkpointing.add_safe_types`)."""
    obj.load_state_dict(load_registered_state(_custom_file(path, index)))
