"""What hardware: one class per device type."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch


class Device(ABC):
    """A kind of hardware and how processes use it.

    Attributes:
        name: torch's device type ("cpu", "cuda").
        dist_backend: the process-group backend for this hardware.
        distributed_type: Accelerate's value for a multi-process run on it.
    """

    name: ClassVar[str]
    dist_backend: ClassVar[str]
    distributed_type: ClassVar[str]

    @staticmethod
    @abstractmethod
    def is_available() -> bool:
        """True when this hardware can be used in this process."""

    @staticmethod
    @abstractmethod
    def device_count() -> int:
        """How many devices of this kind this process sees."""

    @abstractmethod
    def torch_device(self, local_rank: int) -> torch.device:
        """The torch.device a process with ``local_rank`` computes on."""

    def setup(self, device: torch.device) -> None:  # noqa: B027 - optional hook
        """Make ``device`` current for this process (no-op where there is no such notion)."""

    def synchronize(self) -> None:  # noqa: B027 - optional hook
        """Wait for queued work on the device."""

    def empty_cache(self) -> None:  # noqa: B027 - optional hook
        """Release cached memory back to the device."""

    def memory_allocated(self, device: torch.device) -> int:
        """Bytes allocated by tensors on ``device`` (0 where not tracked)."""
        return 0

    @staticmethod
    def compute_capability() -> tuple[int, int] | None:
        """(major, minor) of this process's current device where the hardware has that notion, else None."""
        return None

    @staticmethod
    def device_label() -> str:
        """A human-readable name of the current device, for messages."""
        return "the host CPU"

    @property
    def autocast_device_type(self) -> str:
        return self.name
