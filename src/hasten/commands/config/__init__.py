"""``hasten config``: the questionnaire; ``hasten config default``: a file from the detected hardware;
``hasten config update``: rewrite an old file with the current keys.

The modules mirror Accelerate's ``accelerate.commands.config`` package: ``config`` (the questionnaire command),
``cluster`` / ``sagemaker`` (the questions), ``default``, ``update``, ``config_args`` (the file as a dataclass)
and ``config_utils``.
"""

from __future__ import annotations

import argparse
from typing import Any

from hasten._lazy import accelerate_path_getattr
from hasten.commands.config.config import config_command, config_command_parser, register
from hasten.commands.config.default import default_command_parser, write_basic_config
from hasten.commands.config.update import update_command_parser

__all__ = ["config_command", "config_command_parser", "default_command_parser", "get_config_parser", "main",
           "register", "update_command_parser", "write_basic_config"]

# Accelerate's ``accelerate.commands.config`` names (read by ``transformers env`` / ``trl env``), resolved on
# first use so that the CLI's start-up does not read the configuration file.
_CONFIG_ARGS = ("default_config_file", "load_config_from_file")


_accelerate_path = accelerate_path_getattr(__name__, globals())


def __getattr__(name: str) -> Any:
    if name in _CONFIG_ARGS:
        from hasten.commands.config import config_args

        return getattr(config_args, name)
    if name == "config_args":
        import importlib

        return importlib.import_module("hasten.commands.config.config_args")
    return _accelerate_path(name)  # what Accelerate's module shows from elsewhere (hasten/_accelerate_shown.py)


def get_config_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The ``config`` parser with its ``default`` and ``update`` subcommands, added to ``subparsers`` or
    standalone (``hasten config``'s own parser)."""
    return config_command_parser(subparsers)


def main(argv: list[str] | None = None) -> int:
    """Console script `hasten-config`: this command alone."""
    parser = get_config_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 1
    return int(args.func(args) or 0)
