"""Accelerate's ``accelerate.utils.constants`` path: the very module :mod:`hasten.base.constants` (an alias, so
identity, ``isinstance`` and monkeypatching behave as in Accelerate)."""

import sys
from typing import TYPE_CHECKING

from hasten.base import constants as _ground

if TYPE_CHECKING:
    from hasten.base.constants import *  # noqa: F403

sys.modules[__name__] = _ground
