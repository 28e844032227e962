"""Accelerate's ``accelerate.utils.versions``: compare installed versions with a requirement.

Example:
    >>> from hasten.base.versions import is_torch_version
    >>> is_torch_version(">=", "2.0")
    True
"""

from __future__ import annotations

import importlib.metadata

from packaging.version import parse

from hasten._lazy import accelerate_path_getattr
from hasten.base.imports import compare_versions, is_torch_version

#: The installed torch's version (a ``packaging`` ``Version``), as Accelerate exposes it.
torch_version = parse(importlib.metadata.version("torch"))

__all__ = ["compare_versions", "is_torch_version", "torch_version"]

# Names Accelerate's module at this path shows but defines elsewhere (hasten/_accelerate_shown.py).
__getattr__ = accelerate_path_getattr(__name__, globals())
