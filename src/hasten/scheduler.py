"""Accelerate's ``accelerate.scheduler`` module path (the class lives in :mod:`hasten.optim`)."""

from hasten._lazy import accelerate_path_getattr
from hasten.optim import AcceleratedScheduler

__all__ = ["AcceleratedScheduler"]

# Names Accelerate's module at this path shows but defines elsewhere (hasten/_accelerate_shown.py).
__getattr__ = accelerate_path_getattr(__name__, globals())
