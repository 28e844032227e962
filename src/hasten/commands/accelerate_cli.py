"""Accelerate's ``accelerate.commands.accelerate_cli`` path: ``main`` is the ``hasten`` command line."""

from __future__ import annotations

from hasten.commands.main import main

__all__ = ["main"]
