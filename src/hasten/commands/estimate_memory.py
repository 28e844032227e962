"""``hasten estimate-memory``: how much memory a model needs, computed offline on the meta device.

The model is built with ``init_empty_weights`` (nothing allocated) from one of:
  * a local folder with a ``config.json`` (or the ``config.json`` itself): a transformers model;
  * a Python class path, ``package.module:Class`` (or ``package.module.Class``) with ``--model_kwargs`` JSON;
  * a transformers model name, only if its config is already in the local Hugging Face cache (nothing is
    ever downloaded).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "int4": 0.5}
# Adam in float32: weights + gradients + two moments = 16 bytes per parameter. Mixed precision keeps
# half-precision weights and gradients plus float32 master weights and moments: 2 + 2 + 4 + 8 = 16 as well.
ADAM_BYTES_PER_PARAM = {"float32": 16, "float16": 16, "bfloat16": 16}


class EstimateError(ValueError):
    """A model that cannot be built offline; the message says why and what to pass instead."""


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``estimate-memory`` subcommand."""
    parser = subparsers.add_parser(
        "estimate-memory", help="Estimate the memory a model needs (built on the meta device, offline).",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_name", help="a local model folder / config.json, a class path 'pkg.module:Class', "
                                           "or a transformers model name present in the local cache")
    parser.add_argument("--library_name", "--library-name", choices=["transformers"], default=None,
                        help="the library the model comes from (only transformers is supported)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float16", "int8", "int4"],
                        choices=list(DTYPE_BYTES), help="dtypes to show (default: float32 float16 int8 int4)")
    parser.add_argument("--model_kwargs", "--model-kwargs", default="{}",
                        help="JSON object of keyword arguments for a class path, e.g. '{\"hidden\": 1024}'")
    parser.add_argument("--trust_remote_code", "--trust-remote-code", action="store_true",
                        help="allow a transformers config folder to run its own modelling code")
    from hasten.commands.estimate_train import add_train_arguments

    add_train_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Entry point of ``hasten estimate-memory``: print the table (the plan with ``--train``), or one clear
    error (exit code 2)."""
    from hasten.commands.estimate_train import check_train_flags, run_train

    if getattr(args, "train", False):
        return run_train(args)
    misuse = check_train_flags(args) if hasattr(args, "train") else None
    if misuse:
        print(f"hasten estimate-memory: error: {misuse}", file=sys.stderr)
        return 2
    try:
        model, label = build_empty_model(args.model_name, args.model_kwargs, args.trust_remote_code)
    except EstimateError as exc:
        print(f"hasten estimate-memory: error: {exc}", file=sys.stderr)
        return 2
    print(format_table(label, estimate(model, args.dtypes)))
    return 0


def _is_class_path(name: str) -> bool:
    if ":" in name:
        return True
    if "/" in name or "." not in name:
        return False
    try:
        importlib.import_module(name.rsplit(".", 1)[0])
    except ImportError:
        return False
    return True


def build_empty_model(name: str, model_kwargs: str = "{}", trust_remote_code: bool = False) -> tuple[Any, str]:
    """Build the model named by ``name`` on the meta device; returns ``(model, label)``.

    Raises:
        EstimateError: the name is neither a local folder/config, an importable class, nor a cached model.
    """
    from hasten.big_modeling import init_empty_weights

    path = Path(name)
    if path.exists():
        return _from_transformers_config(path, trust_remote_code, local=True), str(path)
    if _is_class_path(name):
        module_name, _, class_name = name.rpartition(":") if ":" in name else name.rpartition(".")
        try:
            kwargs = json.loads(model_kwargs)
        except json.JSONDecodeError as exc:
            raise EstimateError(f"--model_kwargs {model_kwargs!r} is not JSON ({exc}); pass e.g. '{{\"d\": 64}}'.") \
                from exc
        if not isinstance(kwargs, dict):
            raise EstimateError(f"--model_kwargs must be a JSON object, got {model_kwargs!r}.")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as exc:
            raise EstimateError(f"cannot import {class_name!r} from {module_name!r} ({exc}).") from exc
        with init_empty_weights():
            return cls(**kwargs), name
    return _from_transformers_config(name, trust_remote_code, local=False), name


def _from_transformers_config(source: str | Path, trust_remote_code: bool, local: bool) -> Any:
    from hasten.big_modeling import init_empty_weights

    try:
        import transformers
    except ImportError as exc:
        raise EstimateError(f"{str(source)!r} is a transformers model but transformers is not installed. HINT: pip "
                            "install transformers, or pass a class path 'package.module:Class'.") from exc
    source_path = Path(source)
    if local and source_path.is_file():
        source_path = source_path.parent if source_path.name == "config.json" else source_path
    if local and source_path.is_dir() and not (source_path / "config.json").is_file():
        raise EstimateError(f"the folder {str(source_path)!r} has no config.json: pass a transformers model folder.")
    try:
        config = transformers.AutoConfig.from_pretrained(str(source_path) if local else str(source),
                                                         trust_remote_code=trust_remote_code, local_files_only=True)
    except (OSError, ValueError) as exc:
        if local:
            raise EstimateError(f"cannot read the transformers config in {str(source_path)!r} ({exc}).") from exc
        raise EstimateError(
            f"{str(source)!r} is not a local folder, not an importable class, and its config is not in the local "
            "Hugging Face cache. hasten estimate-memory works offline and never downloads: download the model's "
            "config.json first (e.g. `huggingface-cli download NAME config.json`) and pass the folder, or pass "
            "a class path 'package.module:Class'.") from exc
    with init_empty_weights():
        return transformers.AutoModel.from_config(config, trust_remote_code=trust_remote_code)


def estimate(model: Any, dtypes: list[str]) -> list[dict[str, Any]]:
    """One row per dtype: total size, largest layer and Adam training size, in bytes (None when N/A).

    Sizes assume every floating-point weight is stored in the dtype (integer buffers keep their size).

    Example:
        >>> estimate(torch.nn.Linear(1000, 1000), ["float32"])[0]["total"]
        4004000
    """
    from hasten.big_modeling import calculate_maximum_sizes

    total, (largest, names) = calculate_maximum_sizes(model)
    params = sum(p.numel() for p in model.parameters())
    rows = []
    for dtype in dtypes:
        ratio = DTYPE_BYTES[dtype] / 4  # the model is built in float32
        adam = ADAM_BYTES_PER_PARAM.get(dtype)
        rows.append({"dtype": dtype, "total": int(total * ratio), "largest": int(largest * ratio),
                     "largest_names": names, "training": None if adam is None else params * adam,
                     "parameters": params})
    return rows


def _human(size: int | None) -> str:
    if size is None:
        return "N/A"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.2f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{value:.2f} TiB"


def format_table(label: str, rows: list[dict[str, Any]]) -> str:
    """The rows as a plain-text table (works in any terminal and in logs)."""
    header = ("dtype", "Largest layer", "Total size", "Training using Adam")
    body = [(r["dtype"], _human(r["largest"]), _human(r["total"]), _human(r["training"])) for r in rows]
    widths = [max(len(str(line[i])) for line in [header, *body]) for i in range(4)]
    rule = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    lines = [f"Memory usage for loading `{label}` ({rows[0]['parameters']:,} parameters)" if rows else label, rule,
             "| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |", rule]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |" for line in body]
    lines.append(rule)
    if rows:
        lines.append(f"Largest layer: {', '.join(rows[0]['largest_names'][:3]) or '(whole model)'}. "
                     "Training with Adam counts weights, gradients and optimizer states (16 bytes/parameter), "
                     "not activations.")
    return "\n".join(lines)
