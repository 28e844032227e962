"""``hasten config``: the questionnaire; ``hasten config default``: a file from the detected hardware;
``hasten config update``: rewrite an old file with the current keys."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

# Accelerate's ``accelerate.commands.config`` names (read by ``transformers env`` / ``trl env``), resolved on
# first use so that the CLI's start-up does not read the configuration file.
_CONFIG_ARGS = ("default_config_file", "load_config_from_file")


def __getattr__(name: str) -> Any:
    if name in _CONFIG_ARGS:
        from hasten.commands.config import config_args

        return getattr(config_args, name)
    if name == "config_args":
        import importlib

        return importlib.import_module("hasten.commands.config.config_args")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    """Accelerate's name: the ``config`` parser (with ``default`` and ``update``), added or standalone."""
    from hasten.commands.main import standalone_parser

    return standalone_parser(register, subparsers)


def default_command_parser(parser: Any, parents: list[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add ``default`` to the ``config`` subparsers ``parser``."""
    default = parser.add_parser("default", parents=parents,
                                help="Write a default file for this machine, without questions.")
    default.add_argument("--config_file", "--config-file", dest="save_location", default=None,
                         help="Where to write the file.")
    default.add_argument("--mixed_precision", "--mixed-precision", choices=["no", "fp16", "bf16"], default="no",
                         help="Mixed precision to record.")
    default.set_defaults(func=default_command)
    return default


def update_command_parser(parser: Any, parents: list[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add ``update`` to the ``config`` subparsers ``parser``."""
    update = parser.add_parser("update", parents=parents, help="Rewrite an existing file with the current keys.")
    update.add_argument("--config_file", "--config-file", default=None, help="The file to update.")
    update.set_defaults(func=update_command)
    return update


def _target(path: str | None) -> Path:
    from hasten.config.io import default_config_file

    return Path(path).expanduser() if path else default_config_file()


def write_basic_config(mixed_precision: str = "no", save_location: str | None = None,
                       device_count: int | None = None) -> Path | None:
    """``hasten.config.io.write_basic_config`` (kept here, its earlier home)."""
    from hasten.config.io import write_basic_config as write

    return write(mixed_precision, save_location, device_count)


def config_command(args: argparse.Namespace) -> int:
    """Run the questionnaire and write the file."""
    from hasten.commands.questionnaire import run_questionnaire
    from hasten.config.io import save_config_file
    from hasten.config.schema import LaunchConfig
    from hasten.exceptions import ConfigurationError

    try:
        config = LaunchConfig.from_dict(run_questionnaire(), source="your answers")
        path = save_config_file(config, _target(args.config_file))
    except ConfigurationError as exc:
        print(f"hasten config: error: {exc}", file=sys.stderr)
        return 2
    print(f"hasten configuration saved at {path}")
    return 0


def default_command(args: argparse.Namespace) -> int:
    """``hasten config default``."""
    path = write_basic_config(args.mixed_precision, args.save_location)
    if path is None:
        print(f"hasten config default: {_target(args.save_location)} already exists; not overwriting it. "
              "HINT: delete it or run `hasten config` to answer the questions again.", file=sys.stderr)
        return 1
    print(f"hasten configuration saved at {path}")
    return 0


def update_command(args: argparse.Namespace) -> int:
    """``hasten config update``: load with legacy conversions, write back with current keys."""
    from hasten.config.io import load_config_file, read_config_dict, save_config_file
    from hasten.config.schema import LaunchConfig
    from hasten.exceptions import ConfigurationError

    path = _target(args.config_file)
    if not path.is_file():
        print(f"hasten config update: {path} does not exist. HINT: create it with `hasten config`.",
              file=sys.stderr)
        return 2
    try:
        data, _ = read_config_dict(path)
        block = dict(data.get("fsdp_config") or {}) if isinstance(data, dict) else {}
        if "fsdp_backward_prefetch_policy" in block:  # renamed in Accelerate 0.20
            block.setdefault("fsdp_backward_prefetch", block.pop("fsdp_backward_prefetch_policy"))
            data["fsdp_config"] = block
            config = LaunchConfig.from_dict(data, source=str(path))
        else:
            config = load_config_file(path)
        save_config_file(config, path.with_suffix(".yaml") if path.suffix == ".json" else path)
    except ConfigurationError as exc:
        print(f"hasten config update: error: {exc}", file=sys.stderr)
        return 2
    print(f"Successfully updated the configuration file at {path}.")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Console script `hasten-config`: this command alone."""
    parser = config_command_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)
