"""NVIDIA (and ROCm) GPUs through torch.cuda; processes meet over NCCL.

Kept thin: the device per local rank, making it current, cache and memory queries. Everything that
decides *what* to do lives in device-agnostic code.
"""

from __future__ import annotations

import torch

from hasten.devices.base import Device


class CUDADevice(Device):
    """A CUDA GPU per local process."""

    name = "cuda"
    dist_backend = "nccl"
    distributed_type = "MULTI_GPU"

    @staticmethod
    def is_available() -> bool:
        return torch.cuda.is_available()

    @staticmethod
    def device_count() -> int:
        return torch.cuda.device_count()

    @staticmethod
    def compute_capability() -> tuple[int, int] | None:
        if not torch.cuda.is_available():
            return None
        major, minor = torch.cuda.get_device_capability()
        return int(major), int(minor)

    @staticmethod
    def device_label() -> str:
        return torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA GPU"

    def torch_device(self, local_rank: int) -> torch.device:
        count = max(torch.cuda.device_count(), 1)
        # More local processes than visible GPUs (or CUDA_VISIBLE_DEVICES set per process): wrap around.
        return torch.device("cuda", local_rank % count)

    def setup(self, device: torch.device) -> None:
        torch.cuda.set_device(device)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self, device: torch.device) -> int:
        return int(torch.cuda.memory_allocated(device))
