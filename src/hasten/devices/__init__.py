"""Devices: what hardware this process computes on."""

from __future__ import annotations

from hasten.devices.base import Device
from hasten.devices.cpu import CPUDevice
from hasten.devices.cuda import CUDADevice

# Preference order when nothing is forced: the first available accelerator wins, the CPU is the fallback.
DEVICE_ORDER: tuple[type[Device], ...] = (CUDADevice, CPUDevice)


def select_device(cpu: bool = False, order: tuple[type[Device], ...] = DEVICE_ORDER) -> Device:
    """The device kind for this process: the CPU if ``cpu`` is set, else the first available in ``order``.

    Example:
        >>> select_device(cpu=True).name
        'cpu'
    """
    if cpu:
        return CPUDevice()
    for cls in order:
        if cls.is_available():
            return cls()
    return CPUDevice()


__all__ = ["DEVICE_ORDER", "CPUDevice", "CUDADevice", "Device", "select_device"]
