"""Accelerate's ``accelerate.scheduler`` module path (the class lives in :mod:`hasten.optim`)."""

from hasten.optim import AcceleratedScheduler

__all__ = ["AcceleratedScheduler"]
