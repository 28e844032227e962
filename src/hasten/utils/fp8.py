"""Accelerate's ``accelerate.utils.fp8`` path: the very module :mod:`hasten.base.fp8` (an alias, so
identity, ``isinstance`` and monkeypatching behave as in Accelerate)."""

import sys
from typing import TYPE_CHECKING

from hasten.base import fp8 as _ground

if TYPE_CHECKING:
    from hasten.base.fp8 import *  # noqa: F403

sys.modules[__name__] = _ground
