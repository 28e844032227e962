"""Compatibility name for ``accelerate.data_loader``: everything lives in :mod:`hasten.data`."""

from hasten._lazy import accelerate_path_getattr
from hasten.data import *  # noqa: F401,F403
from hasten.data import __all__  # noqa: F401

# Names Accelerate's module at this path shows but defines elsewhere (hasten/_accelerate_shown.py).
__getattr__ = accelerate_path_getattr(__name__, globals())
