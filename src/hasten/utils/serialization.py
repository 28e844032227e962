"""Accelerate's ``accelerate.utils.serialization`` path: the very module :mod:`hasten.base.serialization` (an alias, so
identity, ``isinstance`` and monkeypatching behave as in Accelerate)."""

import sys
from typing import TYPE_CHECKING

from hasten.base import serialization as _ground

if TYPE_CHECKING:
    from hasten.base.serialization import *  # noqa: F403

sys.modules[__name__] = _ground
