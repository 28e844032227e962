"""Accelerate's ``accelerate.commands.config.sagemaker``: hasten does not launch on Amazon SageMaker."""

from __future__ import annotations

from typing import NoReturn


def get_sagemaker_input() -> NoReturn:
    """Accelerate asks the SageMaker questions here; hasten has no SageMaker launcher, so this refuses.

    Raises:
        ConfigurationError: always, naming what to use instead.
    """
    from hasten.base.refusals import SAGEMAKER, refusal

    raise refusal("get_sagemaker_input", SAGEMAKER)
