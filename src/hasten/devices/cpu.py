"""The CPU: always available; processes meet over gloo."""

from __future__ import annotations

import torch

from hasten.devices.base import Device


class CPUDevice(Device):
    """Computation on the host CPU."""

    name = "cpu"
    dist_backend = "gloo"
    distributed_type = "MULTI_CPU"

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    def torch_device(self, local_rank: int) -> torch.device:
        return torch.device("cpu")
