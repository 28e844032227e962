"""Accelerate's ``accelerate.utils.modeling`` path: the very module :mod:`hasten.base.modeling` (an alias, so
identity, ``isinstance`` and monkeypatching behave as in Accelerate)."""

import sys
from typing import TYPE_CHECKING

from hasten.base import modeling as _ground

if TYPE_CHECKING:
    from hasten.base.modeling import *  # noqa: F403

sys.modules[__name__] = _ground
