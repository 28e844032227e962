"""Miscellaneous helpers exported from ``hasten.utils``."""

from __future__ import annotations


def wait_for_everyone() -> None:
    """Barrier across all processes (a no-op with one process)."""
    from hasten.state import PartialState

    PartialState().wait_for_everyone()
