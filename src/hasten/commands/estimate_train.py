"""``hasten estimate-memory MODEL --train ...``: the memory plan of one training step per process.

Without ``--train`` the command prints the inference table (``estimate_memory.py``, unchanged). With it, the
model is prepared for the layout on fake tensors and a fake process group of ``--num_processes`` ranks and
runs one step (two optimizer steps) inside torch's memory tracker (``hasten.plan_memory``). ``--json``
prints the plan as one JSON object; ``--budget`` plans every layout hasten can plan for that many processes
and lists the ones that fit, cheapest communication first, each with the largest batch size per process
that fits (``hasten.memory_plan.search``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

#: The flags that only mean something with --train, and their defaults (any other value without --train
#: is a mistake).
TRAIN_DEFAULTS: dict[str, Any] = {
    "batch_size": None, "seq_len": None, "input_shape": None, "num_processes": 1, "layout": None, "budget": None,
    "json": False, "optimizer": "adamw", "momentum": 0.0, "mixed_precision": "no", "device_type": "cuda",
    "activation_checkpointing": False, "reshard_after_forward": None, "gradient_accumulation_steps": 1,
    "deepspeed_config": None}


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--train`` flags of ``hasten estimate-memory``."""
    group = parser.add_argument_group("training plan (--train)")
    group.add_argument("--train", action="store_true", help="plan one training step per process instead of the "
                       "inference table (fake tensors, nothing allocated)")
    group.add_argument("--batch_size", "--batch-size", type=int, default=None, help="samples per process")
    group.add_argument("--seq_len", "--seq-len", type=int, default=None, help="tokens per sample (token-id inputs)")
    group.add_argument("--input_shape", "--input-shape", default=None,
                       help="shape of one float sample, e.g. '3,224,224' (instead of --seq_len)")
    group.add_argument("--num_processes", "--num-processes", type=int, default=1, help="the world size to plan for")
    group.add_argument("--layout", default=None, help="ParallelismConfig sizes: 'dp_replicate=N' (DDP, default), 'dp_shard=N' (FSDP2), "
                       "'dp_replicate=R,dp_shard=S' (HSDP), 'tp=T' or 'dp_shard=S,tp=T' (tensor parallel), "
                       "'zero=2' or 'zero=3' (DeepSpeed ZeRO)")
    group.add_argument("--optimizer", default="adamw", help="adamw, adam or sgd (default adamw)")
    group.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (default 0)")
    group.add_argument("--mixed_precision", "--mixed-precision", default="no",
                       help="no, bf16 or fp16 (with its GradScaler); fp8 cannot be planned")
    group.add_argument("--gradient_accumulation_steps", "--gradient-accumulation-steps", type=int, default=1,
                       help="micro-batches of --batch_size per optimizer step (default 1)")
    group.add_argument("--deepspeed_config", "--deepspeed-config", default=None,
                       help="with --layout zero=2|3: a DeepSpeed config JSON whose bucket sizes size ZeRO's buffers")
    group.add_argument("--device_type", "--device-type", default="cuda",
                       help="cuda (default) or cpu: picks torch's optimizer implementation and hasten's gloo settings")
    group.add_argument("--activation_checkpointing", "--activation-checkpointing", action="store_true",
                       help="FSDP2: recompute each wrapped block's activations in backward")
    group.add_argument("--reshard_after_forward", "--reshard-after-forward", default=None,
                       help="FSDP2: free gathered parameters after forward (default true)")
    group.add_argument("--budget", default=None, help="memory per process, e.g. 80GiB: list the layouts that fit")
    group.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    parser.set_defaults(**TRAIN_DEFAULTS)


def check_train_flags(args: argparse.Namespace) -> str | None:
    """The error line for training flags given without ``--train`` (None when there are none)."""
    given = [name for name, default in TRAIN_DEFAULTS.items() if getattr(args, name, default) != default]
    if args.train or not given:
        return None
    return f"--{given[0]} plans a training step: add --train (without it estimate-memory prints the inference table)."


def run_train(args: argparse.Namespace) -> int:
    """Print the plan (or the layouts that fit ``--budget``); one error line and exit code 2 on bad input."""
    from hasten.memory_plan import PlanError, format_plan, parse_bytes

    try:
        options = _plan_options(args)
        budget = parse_bytes(args.budget) if args.budget else None
        if budget is None:
            plan = _plan(args.model_name, options, args.layout)
            print(json.dumps(plan.to_dict()) if args.json else format_plan(plan))
            return 0
        return _print_fitting(args, options, budget)
    except (PlanError, ValueError) as exc:
        print(f"hasten estimate-memory: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2


def _plan_options(args: argparse.Namespace) -> dict[str, Any]:
    from hasten.memory_plan import PlanError

    try:
        model_kwargs = json.loads(args.model_kwargs or "{}")
    except json.JSONDecodeError:
        raise PlanError(f"--model_kwargs {args.model_kwargs!r} is not JSON: pass e.g. '{{\"d\": 64}}'.") from None
    if not isinstance(model_kwargs, dict):
        raise PlanError(f"--model_kwargs must be a JSON object, got {args.model_kwargs!r}.")
    shape = None
    if args.input_shape:
        try:
            shape = tuple(int(d) for d in args.input_shape.split(","))
        except ValueError:
            raise PlanError(f"--input_shape {args.input_shape!r} is not a shape: write e.g. '3,224,224'.") from None
    given = None if args.reshard_after_forward is None else str(args.reshard_after_forward).lower()
    if given not in (None, "true", "false"):
        raise PlanError(f"--reshard_after_forward {args.reshard_after_forward!r} is not a boolean: write true or false.")
    reshard = None if given is None else given == "true"
    return {"gradient_accumulation_steps": args.gradient_accumulation_steps,
            "deepspeed_config": _deepspeed_config(args.deepspeed_config),"batch_size": args.batch_size, "seq_len": args.seq_len, "input_shape": shape,
            "num_processes": args.num_processes, "optimizer": args.optimizer, "momentum": args.momentum,
            "mixed_precision": args.mixed_precision, "model_kwargs": model_kwargs, "device_type": args.device_type,
            "reshard_after_forward": reshard, "activation_checkpointing": args.activation_checkpointing}


def _deepspeed_config(path: str | None) -> dict[str, Any] | None:
    from hasten.memory_plan import PlanError

    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanError(f"--deepspeed_config {path!r} cannot be read as JSON ({type(exc).__name__}): pass the "
                        "path of a DeepSpeed config file.") from None
    if not isinstance(config, dict):
        raise PlanError(f"--deepspeed_config {path!r} holds a {type(config).__name__}, not a JSON object.")
    return config


def _plan(model: str, options: dict[str, Any], layout: str | None) -> Any:
    from hasten.memory_plan import plan_memory

    if options.get("deepspeed_config") is not None and not str(layout or "").startswith("zero"):
        options = {**options, "deepspeed_config": None}  # --budget: the config sizes only the ZeRO rows
    return plan_memory(model, layout=layout, **options)


def candidate_layouts(num_processes: int) -> list[tuple[str, str | None, dict[str, Any]]]:
    """Layouts to try for ``--budget``, cheapest communication first: ``(label, layout, plugin settings)``.

    Per step and process, DDP all-reduces the gradients (~2x their bytes). HSDP (``dp_replicate=R,dp_shard=S``)
    moves about as much as FSDP2 in all, but only a 1/S shard of the gradients crosses between replicas (the
    slow link across machines), so more replicas come first. DeepSpeed ZeRO-2 reduce-scatters gradients and
    all-gathers the updated parameters (DDP's volume); ZeRO-3 gathers parameters in forward and again in
    backward, as FSDP2 resharding after forward does. FSDP2 that keeps parameters gathered after forward
    all-gathers them once and reduce-scatters gradients (about DDP's volume, less overlap); resharding after
    forward all-gathers them a second time in backward (~3x); activation checkpointing adds a second forward's
    compute on top. Tensor parallel (``tp=T``, up to 8, one machine's GPUs) all-reduces activations in every
    layer, forward and backward: the most traffic, and it needs the fastest link.
    """
    plain = {"reshard_after_forward": None, "activation_checkpointing": False}
    if num_processes == 1:
        return [("single process", None, plain)]
    shard = f"dp_shard={num_processes}"
    hsdp = [(f"dp_replicate={r},dp_shard={num_processes // r} (HSDP)", f"dp_replicate={r},dp_shard={num_processes // r}",
             plain) for r in range(num_processes - 1, 1, -1) if num_processes % r == 0]
    tensor_parallel = [(f"dp_shard={num_processes // t},tp={t} (FSDP2 + tensor parallel)" if t < num_processes
                        else f"tp={t} (tensor parallel)",
                        f"dp_shard={num_processes // t},tp={t}" if t < num_processes else f"tp={t}", plain)
                       for t in (2, 4, 8) if t <= num_processes and num_processes % t == 0]
    return [(f"dp_replicate={num_processes} (DDP)", f"dp_replicate={num_processes}", plain), *hsdp,
            ("zero=2 (DeepSpeed ZeRO-2)", "zero=2", plain),
            (f"{shard} (FSDP2, keep gathered after forward)", shard, {"reshard_after_forward": False}),
            (f"{shard} (FSDP2, reshard after forward)", shard, {"reshard_after_forward": True}),
            ("zero=3 (DeepSpeed ZeRO-3)", "zero=3", plain),
            (f"{shard} (FSDP2, reshard + activation checkpointing)", shard,
             {"reshard_after_forward": True, "activation_checkpointing": True}), *tensor_parallel]


def _layout_row(args: argparse.Namespace, options: dict[str, Any], layout: str | None, label: str,
                budget: int) -> dict[str, Any]:
    """One ``--budget`` row: the peak at ``--batch_size`` and the largest batch size that fits."""
    from hasten.memory_plan.search import largest_batch_size

    peaks: dict[int, int] = {}

    def peak_at(size: int) -> int:
        if size not in peaks:
            peaks[size] = _plan(args.model_name, {**options, "batch_size": size}, layout).peak_bytes
        return peaks[size]

    peak = peak_at(args.batch_size)
    return {"layout": label, "peak_bytes": peak, "fits": peak <= budget,
            "largest_batch_size": largest_batch_size(peak_at, budget, start=args.batch_size)}


def _print_fitting(args: argparse.Namespace, options: dict[str, Any], budget: int) -> int:
    from hasten.memory_plan import PlanError, format_bytes

    rows = []
    for index, (label, layout, settings) in enumerate(candidate_layouts(args.num_processes)):
        try:
            rows.append(_layout_row(args, {**options, **settings}, layout, label, budget))
        except PlanError as exc:
            if index == 0:  # the first layout fails on what every layout shares (the model, the batch): exit 2
                raise
            rows.append({"layout": label, "error": str(exc).splitlines()[0]})  # e.g. a model without a TP plan
    if args.json:
        print(json.dumps({"budget_bytes": budget, "batch_size": args.batch_size, "layouts": rows}))
        return 0
    print(f"Layouts for {args.num_processes} process(es) within {format_bytes(budget)} per process "
          f"(cheapest communication first), at batch size {args.batch_size} per process:")
    for row in rows:
        if "error" in row:
            print(f"  {row['layout']}: cannot be planned: {row['error']}")
            continue
        mark = "fits" if row["fits"] else "does not fit"
        largest = row["largest_batch_size"]
        print(f"  {row['layout']}: peak {format_bytes(row['peak_bytes'])} per process, {mark}; "
              + (f"largest batch size that fits: {largest}" if largest else "not even batch size 1 fits"))
    if not any(row.get("largest_batch_size") for row in rows):
        print("  none fits: lower --seq_len, add processes, or use bf16 mixed precision.")
    return 0
