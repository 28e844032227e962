"""Launchers: how processes are created (torchrun's elastic agent in-process, mpirun, SLURM tasks, a plain
subprocess, and fork-based ``notebook_launcher`` / ``debug_launcher``).

Only Accelerate's names (``notebook_launcher``, ``debug_launcher``, ``test_launch``, ``PrepareForLaunch``)
are offered here, resolved lazily, so that ``hasten launch`` pays only for the launcher it uses; import
``hasten.launchers.plan``, ``hasten.launchers.torchrun``, ... directly for the rest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hasten._lazy import lazy_getattr

_EXPORTS = {"notebook_launcher": "hasten.launchers.notebook", "debug_launcher": "hasten.launchers.notebook",
            "test_launch": "hasten.launchers.compat", "PrepareForLaunch": "hasten.launchers.compat"}

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time the names resolve on first use
    from hasten.launchers.compat import PrepareForLaunch as PrepareForLaunch, test_launch as test_launch
    from hasten.launchers.notebook import (
        debug_launcher as debug_launcher,
        notebook_launcher as notebook_launcher,
    )

__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))


__all__ = sorted(_EXPORTS)  # noqa: PLE0605
