"""Module-level ``__getattr__`` for facades whose public names are imported on first use.

``import hasten`` (and so ``hasten launch``) stays fast because a facade names where each export lives
instead of importing it; the first access imports that module and caches the value in the facade.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, exports: Mapping[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A ``__getattr__`` for module ``package``: ``exports`` maps each name to the module that defines it.

    Example:
        >>> __getattr__ = lazy_getattr(__name__, {"Accelerator": "hasten.accelerator.core"}, globals())
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name) or _shown_source(package, name)
        if module is None:
            # A submodule is an attribute of its package once imported; Accelerate's eager ``__init__``
            # imports them all, so ``accelerate.utils.modeling`` works without an import: so does hasten's.
            if not name.startswith("__") and _is_submodule(package, name):
                return importlib.import_module(f"{package}.{name}")
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # later lookups skip this function
        return value

    return __getattr__


def _is_submodule(package: str, name: str) -> bool:
    """Whether ``package.name`` is an importable submodule. Only a package has submodules: asking
    ``find_spec`` below a plain module raises ``ModuleNotFoundError``, and a module ``__getattr__`` must
    answer ``AttributeError`` (``hasattr`` and ``getattr(m, name, default)`` rely on it)."""
    if not hasattr(sys.modules.get(package), "__path__"):
        return False
    try:
        return importlib.util.find_spec(f"{package}.{name}") is not None
    except ImportError:  # a broken or refused submodule: not an attribute either
        return False


def accelerate_path_getattr(package: str, namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A ``__getattr__`` for a hasten module at one of Accelerate's paths: the names that path shows in
    Accelerate but hasten defines elsewhere resolve from :mod:`hasten._accelerate_paths`, on first use.

    Example:
        >>> __getattr__ = accelerate_path_getattr(__name__, globals())
    """

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):  # import machinery probes (__path__, __all__...): never Accelerate names
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        from hasten._accelerate_paths import PATHS

        module = PATHS.get(package, {}).get(name) or _shown_source(package, name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__


def _shown_source(package: str, name: str) -> str | None:
    """Where a name ``package`` shows in Accelerate but defines elsewhere lives in hasten
    (:mod:`hasten._accelerate_shown`: ``hasten.checkpointing.MODEL_NAME`` is ``hasten.utils.constants``')."""
    if name.startswith("__"):
        return None
    from hasten._accelerate_shown import SHOWN

    if package.startswith("hasten.base."):  # the ground module that hasten.utils.<module> aliases
        package = "hasten.utils." + package[len("hasten.base."):]
    return SHOWN.get(package, {}).get(name)
