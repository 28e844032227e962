"""Module-level ``__getattr__`` for facades whose public names are imported on first use.

``import hasten`` (and so ``hasten launch``) stays fast because a facade names where each export lives
instead of importing it; the first access imports that module and caches the value in the facade.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, exports: Mapping[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A ``__getattr__`` for module ``package``: ``exports`` maps each name to the module that defines it.

    Example:
        >>> __getattr__ = lazy_getattr(__name__, {"Accelerator": "hasten.accelerator.core"}, globals())
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            # A submodule is an attribute of its package once imported; Accelerate's eager ``__init__``
            # imports them all, so ``accelerate.utils.modeling`` works without an import: so does hasten's.
            if not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}") is not None:
                return importlib.import_module(f"{package}.{name}")
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # later lookups skip this function
        return value

    return __getattr__
