"""``hasten.install_as_accelerate()``: make ``import accelerate`` give hasten, for libraries that import it.

Transformers' ``Trainer``, TRL and PEFT import ``accelerate`` themselves. After
``install_as_accelerate()``, ``import accelerate`` and every ``accelerate.X.Y`` resolve to hasten's own
module objects (``accelerate.utils is hasten.utils``, so ``isinstance`` checks are shared), the top-level
``accelerate`` reports the Accelerate version hasten mirrors, and so does
``importlib.metadata.version("accelerate")``. It works like PyMySQL's ``install_as_MySQLdb()``: one
finder at the front of ``sys.meta_path`` answers for ``accelerate`` and its submodules (and for the
``accelerate`` distribution's metadata); nothing is written to disk, so pip never sees it.

Only the top-level ``accelerate`` is a module of its own (a thin one: its version differs from
hasten's); every attribute it has comes from ``hasten``, and every submodule *is* hasten's.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
import types
from collections.abc import Iterator, Sequence
from typing import Any

#: The Accelerate release whose public API hasten mirrors (``tests/fixtures/accelerate_inventory.json``).
ACCELERATE_VERSION = "1.15.0"

_ALIAS = "accelerate"
_TARGET = "hasten"
#: The line of ``compat/accelerate/accelerate/__init__.py`` that marks hasten's ``accelerate`` distribution.
_COMPAT_MARKER = "__hasten_compat__ = True"
_METADATA = f"Metadata-Version: 2.1\nName: accelerate\nVersion: {ACCELERATE_VERSION}\nSummary: hasten, installed as accelerate\n"


class _TopLevelLoader(importlib.abc.Loader):
    """Creates the thin top-level ``accelerate`` module: hasten's names, Accelerate's version."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return types.ModuleType(_ALIAS, "hasten, installed as accelerate (hasten.install_as_accelerate)")

    def exec_module(self, module: types.ModuleType) -> None:
        hasten = importlib.import_module(_TARGET)
        module.__dict__.update(__version__=ACCELERATE_VERSION, __all__=list(hasten.__all__),
                               __getattr__=_top_level_getattr,
                               __dir__=lambda: sorted(set(dir(hasten)) | {"__version__"}))


def _top_level_getattr(name: str) -> Any:
    """``accelerate.<name>``: hasten's public name, or hasten's submodule of that name (as ``import`` sets)."""
    hasten = importlib.import_module(_TARGET)
    try:
        return getattr(hasten, name)
    except AttributeError:
        pass
    if not name.startswith("__") and importlib.util.find_spec(f"{_TARGET}.{name}") is not None:
        return importlib.import_module(f"{_ALIAS}.{name}")
    raise AttributeError(f"module {_ALIAS!r} has no attribute {name!r}")


class _SubmoduleLoader(importlib.abc.Loader):
    """Hands the import system hasten's own module for ``accelerate.<path>`` (the same object)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._spec: Any = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(self.target)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # The import system wrote the alias spec onto the module: hasten's own spec must stay (relative
        # imports and reloads read it). The module is already executed: nothing else to do.
        module.__spec__ = self._spec


class _AliasDistribution(importlib.metadata.Distribution):
    """The ``accelerate`` distribution as ``importlib.metadata`` sees it: name and mirrored version only."""

    def read_text(self, filename: str) -> str | None:
        return _METADATA if filename in ("METADATA", "PKG-INFO") else None

    def locate_file(self, path: Any) -> Any:
        return None


class AccelerateAliasFinder(importlib.abc.MetaPathFinder):
    """The finder ``install_as_accelerate`` puts first on ``sys.meta_path``."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == _ALIAS:
            return importlib.machinery.ModuleSpec(_ALIAS, _TopLevelLoader(), is_package=True)
        if not fullname.startswith(_ALIAS + "."):
            return None
        target_name = _TARGET + fullname[len(_ALIAS):]
        try:
            found = importlib.util.find_spec(target_name)
        except ModuleNotFoundError:  # a parent is not a package: like any missing module
            return None
        if found is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _SubmoduleLoader(target_name),
                                              is_package=found.submodule_search_locations is not None)

    def find_distributions(self, context: Any = None) -> Iterator[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is None or name.replace("_", "-").lower() == _ALIAS:
            yield _AliasDistribution()


def _installed_finder() -> AccelerateAliasFinder | None:
    return next((f for f in sys.meta_path if isinstance(f, AccelerateAliasFinder)), None)


def _is_namespace_package(spec: importlib.machinery.ModuleSpec | None) -> bool:
    """Whether ``spec`` is a namespace package: a folder without ``__init__.py`` (``./accelerate/`` holding
    config files, say). Accelerate is a regular package, so such a folder is never the real one."""
    return (spec is not None and spec.origin is None and spec.submodule_search_locations is not None
            and not isinstance(spec.loader, _TopLevelLoader))


def real_accelerate_installed() -> bool:
    """Whether the real Accelerate package is importable from ``sys.path`` (ignoring hasten's alias).

    A folder named ``accelerate`` without ``__init__.py`` on the path (the working directory, say) does not
    count: it would import as an empty namespace package, and the path finder returns one only when no
    regular package of that name is anywhere on ``sys.path``. Nor does hasten's own ``accelerate``
    distribution (``pip install ./compat/accelerate``), whose import hands the name to this alias.
    """
    spec = importlib.machinery.PathFinder.find_spec(_ALIAS)
    return spec is not None and not _is_namespace_package(spec) and not _is_hasten_distribution(spec)


def _is_hasten_distribution(spec: importlib.machinery.ModuleSpec) -> bool:
    """Whether ``spec`` is hasten's own ``accelerate`` distribution (``compat/accelerate``), which hands the
    name to this alias when imported: its ``__init__.py`` sets ``__hasten_compat__``."""
    try:
        with open(spec.origin or "", encoding="utf-8") as init:
            return _COMPAT_MARKER in init.read(4096)
    except OSError:
        return False


def _imported_namespace_package() -> bool:
    """Whether ``accelerate`` was imported as a namespace package (a folder of that name, not Accelerate)."""
    module = sys.modules.get(_ALIAS)
    return module is not None and _is_namespace_package(getattr(module, "__spec__", None))


def _forget_accelerate_modules() -> None:
    for name in [n for n in sys.modules if n == _ALIAS or n.startswith(_ALIAS + ".")]:
        del sys.modules[name]


def install_as_accelerate() -> None:
    """Make ``import accelerate`` (and ``accelerate.X.Y``) give hasten's own modules, for libraries that import it.

    Afterwards ``accelerate.utils is hasten.utils``, ``accelerate.__version__`` and
    ``importlib.metadata.version("accelerate")`` are the Accelerate version hasten mirrors, and a name
    hasten lacks fails as a missing name in Accelerate does (``ImportError`` / ``AttributeError``).
    Calling it again does nothing. Undo it with ``hasten.uninstall_as_accelerate()``. A folder named
    ``accelerate`` that is not a package (``./accelerate/fsdp.yaml``), even one imported already, gives way.

    Raises:
        ImportError: the real ``accelerate`` is already imported in this process; its modules and hasten's
            cannot both be ``accelerate``. Call this before anything imports ``accelerate``.

    Example:
        >>> import hasten
        >>> hasten.install_as_accelerate()
        >>> from transformers import Trainer  # its ``import accelerate`` now gives hasten
    """
    if _installed_finder() is not None:
        return
    if _imported_namespace_package():  # a folder named accelerate, imported before: hasten takes the name
        _forget_accelerate_modules()
    imported = sys.modules.get(_ALIAS)
    if imported is not None:
        raise ImportError(
            f"install_as_accelerate(): the real accelerate is already imported in this process "
            f"({getattr(imported, '__file__', imported)!r}), so 'accelerate' cannot become hasten. HINT: call "
            "hasten.install_as_accelerate() first, before importing transformers, trl, peft or accelerate, or "
            "use the real accelerate in this process.")
    sys.meta_path.insert(0, AccelerateAliasFinder())
    importlib.invalidate_caches()


def uninstall_as_accelerate() -> None:
    """Undo ``install_as_accelerate()``: remove the finder and the ``accelerate`` entries of ``sys.modules``.

    Modules that already did ``import accelerate`` keep the objects they hold (hasten's). Does nothing if
    the alias is not installed.

    Example:
        >>> hasten.uninstall_as_accelerate()
    """
    finder = _installed_finder()
    if finder is None:
        return
    sys.meta_path.remove(finder)
    _forget_accelerate_modules()
    importlib.invalidate_caches()


def install_unless_real_accelerate() -> bool:
    """What launchers run in each worker: install the alias when the real Accelerate is not installed.

    Returns whether the alias is installed afterwards. A process that has the real package keeps it; a
    folder named ``accelerate`` that is not a package (``./accelerate/fsdp.yaml``) does not stop it.
    """
    if _installed_finder() is not None:
        return True
    if real_accelerate_installed() or (_ALIAS in sys.modules and not _imported_namespace_package()):
        return False
    install_as_accelerate()
    return True
