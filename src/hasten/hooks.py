"""Accelerate's ``accelerate.hooks`` module path: model hooks for device placement and offloading.

Everything lives in :mod:`hasten.big_modeling`; this module gives it Accelerate's import path.

Example:
    >>> from hasten.hooks import AlignDevicesHook, add_hook_to_module
"""

# ruff: noqa: F401
from hasten._lazy import accelerate_path_getattr
from hasten.big_modeling.attach import (
    attach_align_device_hook,
    attach_align_device_hook_on_blocks,
    attach_execution_device_hook,
)
from hasten.big_modeling.extras import LayerwiseCastingHook
from hasten.big_modeling.hooks import (
    AlignDevicesHook,
    CpuOffload,
    ModelHook,
    SequentialHook,
    UserCpuOffloadHook,
    add_hook_to_module,
    remove_hook_from_module,
    remove_hook_from_submodules,
)

__all__ = ["AlignDevicesHook", "CpuOffload", "LayerwiseCastingHook", "ModelHook", "SequentialHook",
           "UserCpuOffloadHook", "add_hook_to_module", "attach_align_device_hook", "attach_align_device_hook_on_blocks",
           "attach_execution_device_hook", "remove_hook_from_module", "remove_hook_from_submodules"]

# Names Accelerate's module at this path shows but defines elsewhere (hasten/_accelerate_shown.py).
__getattr__ = accelerate_path_getattr(__name__, globals())
