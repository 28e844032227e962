"""Accelerate's ``accelerate.commands.config.default``: ``hasten config default`` writes a file for this
machine's devices without asking anything."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from hasten._lazy import accelerate_path_getattr
from hasten.commands.config.config_utils import SubcommandHelpFormatter, _target

description = "Create a default config file for Accelerate with only a few flags set."


def write_basic_config(mixed_precision: str = "no", save_location: str | None = None,
                       device_count: int | None = None) -> Path | None:
    """Write a configuration for this machine's devices (``hasten.config.io.write_basic_config``); return its
    path, or ``None`` when a file is already there (it is never overwritten).

    Example:
        >>> write_basic_config("bf16", "/tmp/h/default_config.yaml", device_count=0)  # doctest: +SKIP
    """
    from hasten.config.io import write_basic_config as write

    return write(mixed_precision, save_location, device_count)


def default_command_parser(parser: Any, parents: list[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add ``default`` to the ``config`` subparsers ``parser``."""
    default = parser.add_parser("default", parents=parents, formatter_class=SubcommandHelpFormatter,
                                help="Write a default file for this machine, without questions.")
    default.add_argument("--config_file", "--config-file", dest="save_location", default=None,
                         help="Where to write the file.")
    default.add_argument("--mixed_precision", "--mixed-precision", choices=["no", "fp16", "bf16"], default="no",
                         help="Mixed precision to record.")
    default.set_defaults(func=default_config_command)
    return default


def default_config_command(args: argparse.Namespace) -> int:
    """``hasten config default``: write the file; exit status 1 when one is already there."""
    path = write_basic_config(args.mixed_precision, args.save_location)
    if path is None:
        print(f"hasten config default: {_target(args.save_location)} already exists; not overwriting it. "
              "HINT: delete it or run `hasten config` to answer the questions again.", file=sys.stderr)
        return 1
    print(f"hasten configuration saved at {path}")
    return 0

# Names Accelerate's module at this path shows but defines elsewhere (hasten/_accelerate_shown.py).
__getattr__ = accelerate_path_getattr(__name__, globals())
