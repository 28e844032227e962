"""``hasten to-fsdp2 --config_file PATH``: rewrite an FSDP1 launch configuration file for FSDP2."""

from __future__ import annotations

import argparse
import enum
import logging
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class ConversionStatus(enum.Enum):
    """What becomes of an FSDP1 key that has no FSDP2 counterpart (Accelerate's table)."""

    NOT_YET_IMPLEMENTED = 0
    REMOVED = -1


#: Accelerate's FSDP1 -> FSDP2 key table (data; the conversion itself is ``convert_fsdp1_config``).
ARGUMENT_KEY_MAPPING: dict[str, Any] = {
    "fsdp_version": "fsdp_version",
    "fsdp_reshard_after_forward": "fsdp_reshard_after_forward",
    "fsdp_auto_wrap_policy": "fsdp_auto_wrap_policy",
    "fsdp_backward_prefetch": ConversionStatus.REMOVED,
    "fsdp_forward_prefetch": ConversionStatus.NOT_YET_IMPLEMENTED,
    "fsdp_cpu_ram_efficient_loading": "fsdp_cpu_ram_efficient_loading",
    "fsdp_offload_params": "fsdp_offload_params",
    "fsdp_sharding_strategy": "fsdp_reshard_after_forward",
    "fsdp_state_dict_type": "fsdp_state_dict_type",
    "fsdp_sync_module_states": ConversionStatus.REMOVED,
    "fsdp_transformer_layer_cls_to_wrap": "fsdp_transformer_layer_cls_to_wrap",
    "fsdp_min_num_params": "fsdp_min_num_params",
    "fsdp_use_orig_params": ConversionStatus.REMOVED,
    "fsdp_activation_checkpointing": "fsdp_activation_checkpointing",
}
_RESHARD = {"FULL_SHARD": True, "SHARD_GRAD_OP": False, "HYBRID_SHARD": True, "HYBRID_SHARD_ZERO2": False,
            "NO_SHARD": False}
#: Accelerate's value table: sharding strategy -> reshard_after_forward.
ARGUMENT_VALUE_MAPPING: dict[str, dict[str, bool]] = {"fsdp_sharding_strategy": dict(_RESHARD),
                                                      "fsdp_reshard_after_forward": dict(_RESHARD)}


def load_config(config_file: str) -> dict[str, Any]:
    """The settings of a YAML (or JSON) configuration file; an empty file raises ``ValueError``."""
    config = _read(Path(config_file))
    if not config:
        raise ValueError("Config file is empty")
    return config


def convert_config_to_fsdp2(config: dict[str, Any]) -> dict[str, Any]:
    """Rewrite ``config``'s ``fsdp_config`` block for FSDP2, in place, and return ``config``.

    A config without the block, or already at ``fsdp_version: 2``, is returned unchanged (with a log line,
    as in Accelerate). The conversion is hasten's ``convert_fsdp1_config``.

    Example:
        >>> convert_config_to_fsdp2({"fsdp_config": {"fsdp_sharding_strategy": "FULL_SHARD"}})["fsdp_config"]
        {'fsdp_reshard_after_forward': True, 'fsdp_version': 2}
    """
    from hasten.config.plugins.fsdp import convert_fsdp1_config

    block = config.get("fsdp_config", {})
    if not block:
        logger.info("No FSDP config found in the config file, skipping conversion...")
        return config
    if block.get("fsdp_version", 1) == 2:
        logger.warning("Config already specifies FSDP2, skipping conversion...")
        return config
    config["fsdp_config"], notes = convert_fsdp1_config(block)
    for note in notes:
        logger.warning(note)
    return config


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
        data = load_config(str(source))
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
