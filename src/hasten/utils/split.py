"""Accelerate's ``accelerate.utils.split`` path: the very module :mod:`hasten.base.split` (an alias, so
identity, ``isinstance`` and monkeypatching behave as in Accelerate)."""

import sys
from typing import TYPE_CHECKING

from hasten.base import split as _ground

if TYPE_CHECKING:
    from hasten.base.split import *  # noqa: F403

sys.modules[__name__] = _ground
