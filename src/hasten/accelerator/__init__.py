"""The ``Accelerator`` facade.

Like Accelerate's ``accelerate.accelerator`` module, this package also offers the names that module
imports (plugins, kwargs handlers, states, helpers), so ``from hasten.accelerator import X`` works where
``from accelerate.accelerator import X`` did. They resolve lazily through the ``hasten`` and
``hasten.utils`` facades.
"""

from __future__ import annotations

import importlib
from typing import Any

from hasten.accelerator.core import Accelerator

__all__ = ["Accelerator"]

_ELSEWHERE = {"AcceleratedOptimizer": "hasten.optim", "AcceleratedScheduler": "hasten.optim",
              "DataLoaderDispatcher": "hasten.data", "GeneralTracker": "hasten.tracking",
              "ParallelismConfig": "hasten.parallelism_config", "PartialState": "hasten.state",
              "AcceleratorState": "hasten.state", "GradientState": "hasten.state"}


def __getattr__(name: str) -> Any:
    if name in _ELSEWHERE:
        return getattr(importlib.import_module(_ELSEWHERE[name]), name)
    for facade in ("hasten", "hasten.utils"):
        module = importlib.import_module(facade)
        if name in getattr(module, "_EXPORTS", {}):
            return getattr(module, name)
    raise AttributeError(f"module 'hasten.accelerator' has no attribute {name!r}")
