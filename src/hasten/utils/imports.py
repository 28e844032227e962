"""Accelerate's ``accelerate.utils.imports`` path: the very module :mod:`hasten.base.imports` (an alias, so
identity, ``isinstance`` and monkeypatching behave as in Accelerate)."""

import sys
from typing import TYPE_CHECKING

from hasten.base import imports as _ground

if TYPE_CHECKING:
    from hasten.base.imports import *  # noqa: F403

sys.modules[__name__] = _ground
