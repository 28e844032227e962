"""Accelerate's ``accelerate.utils.memory`` path: the very module :mod:`hasten.base.memory` (an alias, so
identity, ``isinstance`` and monkeypatching behave as in Accelerate)."""

import sys
from typing import TYPE_CHECKING

from hasten.base import memory as _ground

if TYPE_CHECKING:
    from hasten.base.memory import *  # noqa: F403

sys.modules[__name__] = _ground
