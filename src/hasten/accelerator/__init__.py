"""The ``Accelerator`` facade."""

from hasten.accelerator.core import Accelerator

__all__ = ["Accelerator"]
