"""DeepSpeed ZeRO checkpoints on another number of processes, through DeepSpeed's universal checkpoint.

ZeRO-1/2 shard the optimizer state by data-parallel rank (``zero_pp_rank_{r}_..._optim_states.pt``),
ZeRO-3 the parameters too, so a checkpoint saved by N processes does not load into M directly.
DeepSpeed's own converter (``deepspeed.checkpoint.ds_to_universal``) turns it into one file per parameter and state
(``zero/<name>/fp32.pt``, ``exp_avg.pt``, ...), which an engine loads on any count when its config says
``checkpoint.load_universal``. hasten runs the converter on load, into a temporary folder (the
checkpoint itself is never modified: its manifest stays exact), once per machine, and removes it after
the load. The files the converter reads were first checked by
:func:`hasten.checkpointing.safe_load.check_deepspeed_files`, like every DeepSpeed file hasten loads.

DeepSpeed 0.19.8 loads a universal checkpoint into a ZeRO-3 engine with two flaws that only show with
more than one parameter group (ZeRO-1/2 load group by group): every group gets the first group's
hyperparameters (``runtime/zero/stage3.py:3685-3691``), and every group's optimizer state gets the
same ``step`` tensor (``stage3.py:3664,3681``), which torch's Adam then advances in place once per
group per step, so the bias correction runs ahead. :func:`repair_zero3_load` undoes both after the load.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
from pathlib import Path
from typing import Any


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
        # The converter reads Adam's two moments by name (ds_to_universal.py:154-155 for ZeRO-1/2, 195-196 for ZeRO-3).
        why = (" DeepSpeed converts the states of Adam-family optimizers only (exp_avg, exp_avg_sq)."
               if isinstance(exc, KeyError) and str(exc).strip("'") in ("exp_avg", "exp_avg_sq") else "")
        raise CheckpointError(f"Converting the DeepSpeed checkpoint {source} to a universal checkpoint (to load it "
                              f"into another number of processes) failed: {type(exc).__name__}: {exc}.{why} Resume "
                              "on the number of processes that saved it.") from exc


def repair_zero3_load(optimizer: Any, output: Path) -> None:
    """After DeepSpeed loaded ``output`` into a ZeRO-3 engine: each group's own hyperparameters and ``step``.

    Args:
        optimizer: the engine's torch optimizer (``engine.optimizer.optimizer``).
        output: the converted folder of that engine; its ``zero/optimizer_state.pt`` holds the saved
            parameter groups, in the order the model's optimizer was built.

    Raises:
        CheckpointError: the saved groups are not there, or not as many as the optimizer's.
    """
    import torch

    from hasten.checkpointing.safe_load import deepspeed_globals, torch_load
    from hasten.exceptions import CheckpointError

    path = output / "zero" / "optimizer_state.pt"
    saved = torch_load(path, path, extra=deepspeed_globals(), mmap=True).get("param_groups")
    if not isinstance(saved, list) or len(saved) != len(optimizer.param_groups):
        count = len(saved) if isinstance(saved, list) else "no"
        raise CheckpointError(f"The converted DeepSpeed checkpoint {output} holds {count} optimizer parameter groups "
                              f"but the optimizer has {len(optimizer.param_groups)}: build the optimizer with the "
                              "groups it was saved with.")
    for group, values in zip(optimizer.param_groups, saved):
        group.update({key: value for key, value in values.items() if key != "params"})
    for state in optimizer.state.values():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = state["step"].clone()  # one counter per group, as torch's optimizers expect


__all__ = ["convert_to_universal", "repair_zero3_load"]
