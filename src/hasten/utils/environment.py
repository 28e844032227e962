"""Accelerate's ``accelerate.utils.environment`` path: the very module :mod:`hasten.base.environment` (an alias, so
identity, ``isinstance`` and monkeypatching behave as in Accelerate)."""

import sys
from typing import TYPE_CHECKING

from hasten.base import environment as _ground

if TYPE_CHECKING:
    from hasten.base.environment import *  # noqa: F403

sys.modules[__name__] = _ground
