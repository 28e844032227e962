"""DeepSpeed ZeRO checkpoints on another number of processes, through DeepSpeed's universal checkpoint.

ZeRO-1/2 shard the optimizer state by data-parallel rank (``zero_pp_rank_{r}_..._optim_states.pt``),
so a checkpoint saved by N processes does not load into M directly. DeepSpeed's own converter
(``deepspeed.checkpoint.ds_to_universal``) turns it into one file per parameter and state
(``zero/<name>/fp32.pt``, ``exp_avg.pt``, ...), which an engine loads on any count when its config says
``checkpoint.load_universal``. hasten runs the converter on load, into a temporary folder (the
checkpoint itself is never modified: its manifest stays exact), once per machine, and removes it after
the load. The files the converter reads were first checked by
:func:`hasten.checkpointing.safe_load.check_deepspeed_files`, like every DeepSpeed file hasten loads.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
from pathlib import Path


def convert_to_universal(source: Path, output: Path) -> None:
    """Convert one engine's folder (``<checkpoint>/pytorch_model``) into a universal one at ``output``.

    Raises:
        CheckpointError: the converter failed (message names the folder and DeepSpeed's reason).
    """
    from deepspeed.checkpoint import ds_to_universal

    from hasten.exceptions import CheckpointError

    args = argparse.Namespace(input_folder=str(source), output_folder=str(output), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True,
                              inject_missing_state=True)  # checkpoints not written by Megatron lack that block
    quiet = io.StringIO()
    try:
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            ds_to_universal.main(args)
    except Exception as exc:
        shutil.rmtree(output, ignore_errors=True)
        raise CheckpointError(f"Converting the DeepSpeed checkpoint {source} to a universal checkpoint (to load it "
                              f"into another number of processes) failed: {type(exc).__name__}: {exc}") from exc


__all__ = ["convert_to_universal"]
