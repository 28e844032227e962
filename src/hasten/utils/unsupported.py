"""Accelerate's ``accelerate.utils.unsupported`` path: the very module :mod:`hasten.base.unsupported` (an alias, so
identity, ``isinstance`` and monkeypatching behave as in Accelerate)."""

import sys
from typing import TYPE_CHECKING

from hasten.base import unsupported as _ground

if TYPE_CHECKING:
    from hasten.base.unsupported import *  # noqa: F403

sys.modules[__name__] = _ground
