"""Accelerate's ``accelerate.utils.deepspeed_runtime`` path: the very module :mod:`hasten.base.deepspeed_runtime` (an alias, so
identity, ``isinstance`` and monkeypatching behave as in Accelerate)."""

import sys
from typing import TYPE_CHECKING

from hasten.base import deepspeed_runtime as _ground

if TYPE_CHECKING:
    from hasten.base.deepspeed_runtime import *  # noqa: F403

sys.modules[__name__] = _ground
