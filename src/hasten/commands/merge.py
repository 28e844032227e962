"""Accelerate's ``accelerate.commands.merge`` names for ``hasten merge-weights``."""

from __future__ import annotations

import argparse
from typing import Any

from hasten._lazy import accelerate_path_getattr
from hasten.commands.merge_weights import description, merge_weights_command, register

__all__ = ["description", "merge_command", "merge_command_parser"]


def merge_command(args: argparse.Namespace) -> int:
    """Merge a sharded checkpoint (``hasten merge-weights``)."""
    return merge_weights_command(args)


def merge_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The ``merge-weights`` parser, added to ``subparsers`` or standalone."""
    from hasten.commands.main import standalone_parser

    return standalone_parser(register, subparsers)


def main(argv: list[str] | None = None) -> int:
    """Console script `hasten-merge-weights`: this command alone."""
    parser = merge_command_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)

# Names Accelerate's module at this path shows but defines elsewhere (hasten/_accelerate_shown.py).
__getattr__ = accelerate_path_getattr(__name__, globals())
