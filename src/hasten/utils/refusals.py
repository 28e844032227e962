"""Accelerate's ``accelerate.utils.refusals`` path: the very module :mod:`hasten.base.refusals` (an alias, so
identity, ``isinstance`` and monkeypatching behave as in Accelerate)."""

import sys
from typing import TYPE_CHECKING

from hasten.base import refusals as _ground

if TYPE_CHECKING:
    from hasten.base.refusals import *  # noqa: F403

sys.modules[__name__] = _ground
