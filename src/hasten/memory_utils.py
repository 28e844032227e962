"""Accelerate's deprecated ``accelerate.memory_utils`` path: importing it warns, as Accelerate's does."""

import warnings

warnings.warn(
    "memory_utils has been reorganized to utils.memory. Import `find_executable_batchsize` from the main "
    "`__init__`: `from hasten import find_executable_batch_size` to avoid this warning.",
    FutureWarning,
    stacklevel=2,
)
