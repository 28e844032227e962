"""Accelerate's ``accelerate.utils.deepspeed`` path: the very module :mod:`hasten.base.deepspeed` (an alias, so
identity, ``isinstance`` and monkeypatching behave as in Accelerate)."""

import sys
from typing import TYPE_CHECKING

from hasten.base import deepspeed as _ground

if TYPE_CHECKING:
    from hasten.base.deepspeed import *  # noqa: F403

sys.modules[__name__] = _ground
