"""DeepSpeed's precision: the engine casts and scales itself from its config's ``fp16``/``bf16`` blocks.

hasten adds no autocast and no GradScaler on top (the engine's loss scaler and its fp32 master
weights would fight them); this class writes the blocks for the run's ``mixed_precision``.
"""

from __future__ import annotations

from typing import Any

from hasten.precision.base import Precision


class DeepSpeedPrecision(Precision):
    """``mixed_precision`` carried out by the DeepSpeed engine.

    Args:
        mixed_precision: "no", "fp16" or "bf16" (what the Accelerator was asked for).
        device_type: this process's device type.
    """

    def __init__(self, mixed_precision: str, device_type: str = "cpu") -> None:
        super().__init__(device_type)
        self.requested = mixed_precision

    @property
    def mixed_precision(self) -> str:  # type: ignore[override]
        return self.requested

    def apply(self, plugin: Any) -> None:
        """Write this precision into the plugin's DeepSpeed config (its fp16/bf16 blocks).

        Raises:
            ConfigurationError: the config already enables the other 16-bit type.
        """
        plugin.set_mixed_precision(self.requested)


__all__ = ["DeepSpeedPrecision"]
