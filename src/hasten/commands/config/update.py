"""Accelerate's ``accelerate.commands.config.update``: ``hasten config update`` rewrites a configuration file
with the current keys (legacy keys converted), keeping its settings."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from hasten._lazy import accelerate_path_getattr
from hasten.commands.config.config_utils import SubcommandHelpFormatter, _target

description = "Update an existing config file with the latest defaults while maintaining the old configuration."


def update_config(args: argparse.Namespace) -> Path:
    """Load ``args.config_file`` (or the default file) with the legacy conversions and write it back with the
    current keys; return the file written (a ``.json`` file is rewritten as ``.yaml`` beside it).

    Raises:
        ConfigurationError: the file does not exist, or it is not a valid configuration.
    """
    from hasten.config.io import load_config_file, read_config_dict, save_config_file
    from hasten.config.schema import LaunchConfig
    from hasten.exceptions import ConfigurationError

    path = _target(getattr(args, "config_file", None))
    if not path.is_file():
        raise ConfigurationError(f"{path} does not exist. HINT: create it with `hasten config`.")
    data, _ = read_config_dict(path)
    block = dict(data.get("fsdp_config") or {}) if isinstance(data, dict) else {}
    if "fsdp_backward_prefetch_policy" in block:  # renamed in Accelerate 0.20
        block.setdefault("fsdp_backward_prefetch", block.pop("fsdp_backward_prefetch_policy"))
        data["fsdp_config"] = block
        config = LaunchConfig.from_dict(data, source=str(path))
    else:
        config = load_config_file(path)
    return save_config_file(config, path.with_suffix(".yaml") if path.suffix == ".json" else path)


def update_command_parser(parser: Any, parents: list[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add ``update`` to the ``config`` subparsers ``parser``."""
    update = parser.add_parser("update", parents=parents, formatter_class=SubcommandHelpFormatter,
                               help="Rewrite an existing file with the current keys.")
    update.add_argument("--config_file", "--config-file", default=None, help="The file to update.")
    update.set_defaults(func=update_config_command)
    return update


def update_config_command(args: argparse.Namespace) -> int:
    """``hasten config update``: exit status 2 when the file is missing or invalid."""
    from hasten.exceptions import ConfigurationError

    path = _target(args.config_file)
    if not path.is_file():
        print(f"hasten config update: {path} does not exist. HINT: create it with `hasten config`.",
              file=sys.stderr)
        return 2
    try:
        update_config(args)
    except ConfigurationError as exc:
        print(f"hasten config update: error: {exc}", file=sys.stderr)
        return 2
    print(f"Successfully updated the configuration file at {path}.")
    return 0

# Names Accelerate's module at this path shows but defines elsewhere (hasten/_accelerate_shown.py).
__getattr__ = accelerate_path_getattr(__name__, globals())
