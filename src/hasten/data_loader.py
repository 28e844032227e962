"""Compatibility name for ``accelerate.data_loader``: everything lives in :mod:`hasten.data`."""

from hasten.data import *  # noqa: F401,F403
from hasten.data import __all__  # noqa: F401
