"""Accelerate's ``accelerate.utils.fsdp2`` path: the very module :mod:`hasten.base.fsdp2` (an alias, so
identity, ``isinstance`` and monkeypatching behave as in Accelerate)."""

import sys
from typing import TYPE_CHECKING

from hasten.base import fsdp2 as _ground

if TYPE_CHECKING:
    from hasten.base.fsdp2 import *  # noqa: F403

sys.modules[__name__] = _ground
