"""Accelerate's ``accelerate.utils.sizes`` path: the very module :mod:`hasten.base.sizes` (an alias, so
identity, ``isinstance`` and monkeypatching behave as in Accelerate)."""

import sys
from typing import TYPE_CHECKING

from hasten.base import sizes as _ground

if TYPE_CHECKING:
    from hasten.base.sizes import *  # noqa: F403

sys.modules[__name__] = _ground
