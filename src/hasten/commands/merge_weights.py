"""``hasten merge-weights CHECKPOINT_DIR OUTPUT_PATH``: a sharded (DCP) model checkpoint -> one weights file."""

from __future__ import annotations

import argparse
import sys
from typing import Any

description = ("Merge the shards of an FSDP2 SHARDED_STATE_DICT checkpoint (a torch.distributed.checkpoint folder such "
               "as pytorch_model_fsdp_0, or the save_state folder holding it) into OUTPUT_PATH/model.safetensors. "
               "Runs in one process on the CPU.")


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``merge-weights`` subcommand (Accelerate's arguments)."""
    parser = subparsers.add_parser(
        "merge-weights", help="Merge a sharded FSDP checkpoint into model.safetensors.",
        description=description)
    parser.add_argument("checkpoint_directory", help="the DCP model folder, or a save_state folder holding one")
    parser.add_argument("output_path", help="folder to write model.safetensors (or pytorch_model.bin) into")
    parser.add_argument("--unsafe_serialization", "--unsafe-serialization", action="store_true",
                        help="write pytorch_model.bin with torch.save instead of safetensors")
    parser.add_argument("--remove_checkpoint_dir", "--remove-checkpoint-dir", action="store_true",
                        help="delete checkpoint_directory after a successful merge")
    parser.set_defaults(func=merge_weights_command)
    return parser


def merge_weights_command(args: argparse.Namespace) -> int:
    """Run the merge; prints the written files, or the reason it failed (exit status 1)."""
    from hasten.checkpointing.dcp import merge_sharded_weights
    from hasten.checkpointing.rng import CheckpointError

    try:
        written = merge_sharded_weights(args.checkpoint_directory, args.output_path,
                                        safe_serialization=not args.unsafe_serialization,
                                        remove_checkpoint_dir=args.remove_checkpoint_dir)
    except CheckpointError as exc:
        print(f"hasten merge-weights: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(f"Merged weights written to {path}")
    return 0
