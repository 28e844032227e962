"""Accelerate's ``accelerate.commands.config.sagemaker``: hasten does not launch on Amazon SageMaker."""

from __future__ import annotations

from typing import NoReturn

from hasten._lazy import accelerate_path_getattr


def get_sagemaker_input() -> NoReturn:
    """Accelerate asks the SageMaker questions here; hasten has no SageMaker launcher, so this refuses.

    Raises:
        ConfigurationError: always, naming what to use instead.
    """
    from hasten.base.refusals import SAGEMAKER, refusal

    raise refusal("get_sagemaker_input", SAGEMAKER)

# Names Accelerate's module at this path shows but defines elsewhere (hasten/_accelerate_shown.py).
__getattr__ = accelerate_path_getattr(__name__, globals())
