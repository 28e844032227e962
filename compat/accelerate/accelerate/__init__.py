"""``accelerate``, provided by hasten: importing this package hands the name over to hasten's alias.

After ``import accelerate``, ``accelerate`` is the module ``hasten.install_as_accelerate()`` makes and every
``accelerate.X.Y`` is hasten's own module (``accelerate.utils is hasten.utils``). Nothing else lives here.
If another distribution named ``accelerate`` (the real one) is also installed on ``sys.path``, the import
refuses, naming both: two packages answering to one name would give whichever comes first on the path.
"""

import importlib
import importlib.metadata
import sys

#: Marks this package as hasten's (``hasten._accelerate_alias.real_accelerate_installed`` reads it).
__hasten_compat__ = True


def _other_accelerate() -> list[str]:
    """``version at location`` of each installed distribution named accelerate that is not this one."""
    found = []
    for dist in importlib.metadata.distributions(name="accelerate"):
        # Path-based distributions only: hasten's alias finder reports a metadata-only "accelerate" too.
        if isinstance(dist, importlib.metadata.PathDistribution) and "+hasten" not in dist.version:
            found.append(f"{dist.version} at {dist.locate_file('')}")
    return found


def _hand_over() -> None:
    real = _other_accelerate()
    if real:
        del sys.modules[__name__]
        raise ImportError(
            f"accelerate: hasten's accelerate distribution ({__file__}) is installed beside the real Accelerate "
            f"({'; '.join(real)}); 'import accelerate' cannot be both. HINT: keep one: run "
            "`pip uninstall accelerate` with the interpreter of the environment that holds the one to drop, or "
            "uninstall hasten's and call hasten.install_as_accelerate() where you want hasten.")
    from hasten._accelerate_alias import install_as_accelerate

    # This half-imported package leaves sys.modules, hasten's alias takes the name, and the import statement
    # that is running returns what sys.modules holds when this file ends: the alias.
    del sys.modules[__name__]
    install_as_accelerate()
    sys.modules[__name__] = importlib.import_module(__name__)


_hand_over()
