"""Accelerate's ``accelerate.commands.config.config``: ``hasten config``, the questionnaire that writes the
configuration file ``hasten launch`` reads (with ``default`` and ``update`` beneath it)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from hasten._lazy import accelerate_path_getattr
from hasten.commands.config.config_utils import _target
from hasten.commands.config.default import default_command_parser
from hasten.commands.config.update import update_command_parser

if TYPE_CHECKING:
    from hasten.commands.config.config_args import ClusterConfig

description = ("Launches a series of prompts to create and save a `default_config.yaml` configuration file for "
               "your training system. Should always be ran first on your machine")


def get_user_input() -> ClusterConfig:
    """Ask the questionnaire's questions on stdin; hasten's questionnaire is the cluster one (it launches on
    local machines and clusters only), so this is :func:`~hasten.commands.config.cluster.get_cluster_input`."""
    from hasten.commands.config.cluster import get_cluster_input

    return get_cluster_input()


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``hasten config`` and its ``default`` / ``update`` subcommands."""
    parser = subparsers.add_parser("config", help="Create the launch configuration file.",
                                   description="Answer a few questions to create the configuration file that "
                                               "`hasten launch` reads.")
    parser.add_argument("--config_file", "--config-file", default=None,
                        help="Where to write the file (default: the default configuration file).")
    parser.set_defaults(func=config_command)
    sub = parser.add_subparsers(dest="config_command", metavar="{default,update}")
    default_command_parser(sub, [])
    update_command_parser(sub, [])
    return parser


def config_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The ``config`` parser (with ``default`` and ``update``), added to ``subparsers`` or standalone."""
    from hasten.commands.main import standalone_parser

    return standalone_parser(register, subparsers)


def config_command(args: argparse.Namespace) -> int:
    """``hasten config``: run the questionnaire and write the file (JSON if its name ends in ``.json``)."""
    from hasten.exceptions import ConfigurationError

    path = _target(args.config_file)
    try:
        config = get_user_input()
        if path.suffix == ".json":
            config.to_json_file(str(path))
        else:
            config.to_yaml_file(str(path))
    except ConfigurationError as exc:
        print(f"hasten config: error: {exc}", file=sys.stderr)
        return 2
    print(f"hasten configuration saved at {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``hasten config`` alone (its subcommands included)."""
    args = config_command_parser().parse_args(argv)
    return int(args.func(args) or 0)

# Names Accelerate's module at this path shows but defines elsewhere (hasten/_accelerate_shown.py).
__getattr__ = accelerate_path_getattr(__name__, globals())
