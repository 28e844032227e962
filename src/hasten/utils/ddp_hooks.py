"""Accelerate's ``accelerate.utils.ddp_hooks`` path: the very module :mod:`hasten.base.ddp_hooks` (an alias, so
identity, ``isinstance`` and monkeypatching behave as in Accelerate)."""

import sys
from typing import TYPE_CHECKING

from hasten.base import ddp_hooks as _ground

if TYPE_CHECKING:
    from hasten.base.ddp_hooks import *  # noqa: F403

sys.modules[__name__] = _ground
