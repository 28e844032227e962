"""Accelerate's ``accelerate.utils.dataclasses`` path: the very module :mod:`hasten.base.dataclasses` (an alias, so
identity, ``isinstance`` and monkeypatching behave as in Accelerate)."""

import sys
from typing import TYPE_CHECKING

from hasten.base import dataclasses as _ground

if TYPE_CHECKING:
    from hasten.base.dataclasses import *  # noqa: F403

sys.modules[__name__] = _ground
