"""Accelerate's ``accelerate.utils.versions`` path: the very module :mod:`hasten.base.versions` (an alias, so
identity, ``isinstance`` and monkeypatching behave as in Accelerate)."""

import sys
from typing import TYPE_CHECKING

from hasten.base import versions as _ground

if TYPE_CHECKING:
    from hasten.base.versions import *  # noqa: F403

sys.modules[__name__] = _ground
