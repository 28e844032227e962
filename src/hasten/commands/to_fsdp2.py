"""``hasten to-fsdp2 --config_file PATH``: rewrite an FSDP1 launch configuration file for FSDP2."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``to-fsdp2`` subcommand (Accelerate's arguments)."""
    parser = subparsers.add_parser(
        "to-fsdp2", help="Convert the FSDP1 settings of a config file to FSDP2.",
        description="Rewrite the fsdp_config block of a launch configuration file for FSDP2: "
                    "fsdp_sharding_strategy becomes fsdp_reshard_after_forward, FSDP1-only keys are removed, "
                    "fsdp_version becomes 2.")
    parser.add_argument("--config_file", "--config-file", required=True, help="the YAML (or JSON) configuration file to convert")
    parser.add_argument("--output_file", "--output-file", default=None, help="where to write the result (required without --overwrite)")
    parser.add_argument("--overwrite", action="store_true", help="replace --config_file in place")
    parser.set_defaults(func=to_fsdp2_command)
    return parser


def to_fsdp2_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """Accelerate's name: the ``to-fsdp2`` parser, added to ``subparsers`` or standalone."""
    from hasten.commands.main import standalone_parser

    return standalone_parser(register, subparsers)


def _read(path: Path) -> dict[str, Any]:
    import json

    import yaml

    text = path.read_text()
    data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a mapping of settings.")
    return data


def _write(data: dict[str, Any], path: Path) -> None:
    import json

    import yaml

    text = json.dumps(data, indent=2) if path.suffix == ".json" else yaml.safe_dump(data, sort_keys=False)
    path.write_text(text)


def to_fsdp2_command(args: argparse.Namespace) -> int:
    """Convert the file; exit status 1 with a message on a missing file or an invalid block."""
    import yaml

    from hasten.config.plugins.fsdp import convert_fsdp1_config

    source = Path(args.config_file).expanduser()
    if args.output_file is None and not args.overwrite:
        print("hasten to-fsdp2: pass --output_file PATH, or --overwrite to replace the config file.", file=sys.stderr)
        return 1
    target = source if args.output_file is None else Path(args.output_file).expanduser()
    if target.exists() and target != source and not args.overwrite:
        print(f"hasten to-fsdp2: {target} exists; pass --overwrite to replace it.", file=sys.stderr)
        return 1
    try:
        data = _read(source)
        block, notes = convert_fsdp1_config(data.get("fsdp_config") or {})
    except (OSError, ValueError, yaml.YAMLError) as exc:
        print(f"hasten to-fsdp2: {exc}", file=sys.stderr)
        return 1
    data["fsdp_config"] = block
    _write(data, target)
    for note in notes:
        print(note)
    print(f"FSDP2 configuration written to {target}")
    return 0
