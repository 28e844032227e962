"""Precision plugins: fp32, bf16 autocast, fp16 autocast with loss scaling, fp8 (torchao float8 linears)."""

from __future__ import annotations

from hasten.base.dataclasses import AutocastKwargs, GradScalerKwargs
from hasten.base.fp8 import AORecipeKwargs
from hasten.exceptions import ConfigurationError
from hasten.precision.amp import BF16Precision, FP16Precision
from hasten.precision.base import Precision, attach_autocast_forward, detach_autocast_forward
from hasten.precision.fp8 import FP8Precision

SUPPORTED = ("no", "fp16", "bf16")


def create_precision(mixed_precision: str, device_type: str, autocast_handler: AutocastKwargs | None = None,
                     scaler_handler: GradScalerKwargs | None = None, fp8_recipe: AORecipeKwargs | None = None) -> Precision:
    """The precision plugin for ``mixed_precision`` on ``device_type``.

    fp8's hardware check happens before (``hasten.connector``), where the device is known.

    Raises:
        ConfigurationError: an unknown or unsupported mode.
    """
    if mixed_precision == "no":
        return Precision(device_type, autocast_handler)
    if mixed_precision == "bf16":
        return BF16Precision(device_type, autocast_handler)
    if mixed_precision == "fp16":
        return FP16Precision(device_type, autocast_handler, scaler_handler)
    if mixed_precision == "fp8":
        return FP8Precision(device_type, autocast_handler, fp8_recipe)
    raise ConfigurationError(f"Unknown mixed_precision {mixed_precision!r}: choose one of {SUPPORTED}.")


__all__ = ["SUPPORTED", "BF16Precision", "FP8Precision", "FP16Precision", "Precision", "attach_autocast_forward",
           "create_precision", "detach_autocast_forward"]
