"""Accelerate's ``accelerate.commands.estimate`` names for ``hasten estimate-memory``."""

from __future__ import annotations

import argparse
from typing import Any

from hasten.commands.estimate_memory import register, run

__all__ = ["estimate_command", "estimate_command_parser"]


def estimate_command(args: argparse.Namespace) -> int:
    """Print the memory table (``hasten estimate-memory``)."""
    return run(args)


def estimate_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The ``estimate-memory`` parser, added to ``subparsers`` or standalone."""
    from hasten.commands.main import standalone_parser

    return standalone_parser(register, subparsers)


def main(argv: list[str] | None = None) -> int:
    """Console script `hasten-estimate-memory`: this command alone."""
    parser = estimate_command_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)
