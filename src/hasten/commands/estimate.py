"""Accelerate's ``accelerate.commands.estimate`` names for ``hasten estimate-memory``."""

from __future__ import annotations

import argparse
from typing import Any

from hasten._lazy import accelerate_path_getattr
from hasten.commands.estimate_memory import register, run

__all__ = ["add_timm_hub_prefix", "check_has_model", "create_ascii_table", "create_empty_model", "estimate_command",
           "estimate_command_parser", "estimate_training_usage", "gather_data", "verify_on_hub"]


def estimate_command(args: argparse.Namespace) -> int:
    """Print the memory table (``hasten estimate-memory``)."""
    return run(args)


def estimate_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The ``estimate-memory`` parser, added to ``subparsers`` or standalone."""
    from hasten.commands.main import standalone_parser

    return standalone_parser(register, subparsers)


def main(argv: list[str] | None = None) -> int:
    """Console script `hasten-estimate-memory`: this command alone."""
    parser = estimate_command_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


def verify_on_hub(repo: str, token: str | None = None) -> Any:
    """The Hub's ``model_info`` for ``repo``, or ``"gated"`` / ``"repo"`` when it is gated or missing
    (asks the Hub: the one network call here; ``hasten estimate-memory`` itself stays offline)."""
    from huggingface_hub import model_info
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        return model_info(repo, token=token)
    except (OSError, GatedRepoError):
        return "gated"
    except RepositoryNotFoundError:
        return "repo"


def check_has_model(error: BaseException) -> str:
    """Which library (``"timm"``, ``"transformers"``) raised ``error`` for a model it could not find, else
    ``"unknown"``."""
    from hasten.base.imports import is_timm_available, is_transformers_available

    message = str(error)
    if is_timm_available() and ((isinstance(error, RuntimeError) and "Unknown model" in message)
                                or type(error).__name__ == "EntryNotFoundError"
                                or (isinstance(error, KeyError) and "architecture" in message)):
        return "timm"
    if is_transformers_available() and isinstance(error, (OSError, ValueError)) and (
            "does not appear to have a file named" in message or "Unrecognized model in" in message):
        return "transformers"
    return "unknown"


def add_timm_hub_prefix(model_name: str) -> str:
    """``hf-hub:`` + a Hub repo id (``org/name``), as ``timm.create_model`` wants; other names unchanged."""
    return model_name if ":" in model_name or "/" not in model_name else f"hf-hub:{model_name}"


def create_empty_model(model_name: str, library_name: str | None, trust_remote_code: bool = False,
                       access_token: str | None = None) -> Any:
    """The model on the meta device, in float32: a transformers model from a local folder, a cached config
    or a class path (``hasten estimate-memory``'s rules, offline), or a timm architecture.

    Raises:
        ValueError: an unsupported ``library_name``; ``EstimateError`` (a ``ValueError``) when the model
            cannot be built offline.
    """
    from hasten.commands.estimate_memory import build_empty_model

    if library_name in (None, "transformers"):
        return build_empty_model(model_name, trust_remote_code=trust_remote_code)[0]
    if library_name == "timm":
        import timm

        from hasten.big_modeling import init_empty_weights

        with init_empty_weights():
            return timm.create_model(add_timm_hub_prefix(model_name), pretrained=False)
    raise ValueError(f"Library `{library_name}` is not supported: pass library_name='transformers' or 'timm'.")


def create_ascii_table(headers: list[str], rows: list[list[str]], title: str) -> str:
    """A boxed text table with a centred ``title`` (Accelerate's ``estimate-memory`` layout)."""
    widths = [max(len(str(value)) for value in [header, *(row[i] for row in rows)]) for i, header in enumerate(headers)]
    inner = sum(widths) + len(widths) - 1
    if len(title) > inner:
        widths[-1] += len(title) - inner
        inner = len(title)

    def line(cells: list[str]) -> str:
        return "│" + "│".join(str(c).center(w) for c, w in zip(cells, widths)) + "│"

    return "\n".join([
        "┌" + "─" * inner + "┐", "│" + title.center(inner) + "│", "├" + "┬".join("─" * w for w in widths) + "┤",
        line(headers), "├" + "┼".join("─" * w for w in widths) + "┤", *(line(row) for row in rows),
        "└" + "┴".join("─" * w for w in widths) + "┘"])


def estimate_training_usage(bytes: int, mixed_precision: str, msamp_config: str | None = None) -> dict[str, int]:
    """Memory for training a ``bytes``-sized (float32) model with Adam at batch size 1, by part: ``model``,
    ``gradients``, ``optimizer`` states and the ``step`` peak (-1 where not estimated; Accelerate's rule)."""
    sizes = {"model": -1, "optimizer": -1, "gradients": -1, "step": -1}
    fp32, fp16 = bytes, bytes // 2
    if mixed_precision == "float32":
        sizes.update(model=fp32, gradients=fp32, optimizer=fp32 * 2, step=fp32 * 4)
    elif mixed_precision in ("float16", "bfloat16") or (mixed_precision == "fp8" and msamp_config is None):
        sizes.update(model=fp32, gradients=fp32 + fp16, optimizer=fp32 * 2, step=fp32 * 2)
    return sizes


def gather_data(args: argparse.Namespace) -> list[list[Any]]:
    """Rows ``[dtype, largest layer bytes, total bytes, training usage]`` for ``args.model_name`` in each of
    ``args.dtypes`` (``args.library_name``, ``args.trust_remote_code`` as for ``create_empty_model``)."""
    from hasten.commands.estimate_memory import estimate

    model = create_empty_model(args.model_name, getattr(args, "library_name", None),
                               trust_remote_code=getattr(args, "trust_remote_code", False))
    full = estimate(model, ["float32"])[0]["total"]
    return [[row["dtype"], row["largest"], row["total"], estimate_training_usage(full, row["dtype"])]
            for row in estimate(model, list(args.dtypes))]

# Names Accelerate's module at this path shows but defines elsewhere (hasten/_accelerate_shown.py).
__getattr__ = accelerate_path_getattr(__name__, globals())
