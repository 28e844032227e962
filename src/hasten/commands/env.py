"""``hasten env``: versions, platform, hardware and the configuration file, ready for a bug report."""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
from typing import Any

from hasten._lazy import accelerate_path_getattr

OPTIONAL_PACKAGES = ("deepspeed", "safetensors", "tensorboard", "wandb", "mlflow", "transformers", "accelerate")


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``hasten env``."""
    parser = subparsers.add_parser("env", help="Print versions and set-up for a bug report.")
    parser.add_argument("--config_file", "--config-file", default=None, help="Configuration file to show.")
    parser.set_defaults(func=env_command)
    return parser


def env_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """Accelerate's name: the ``env`` parser, added to ``subparsers`` or standalone."""
    from hasten.commands.main import standalone_parser

    return standalone_parser(register, subparsers)


def _version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _torch_info() -> dict[str, str]:
    import torch

    info = {"PyTorch version": torch.__version__,
            "PyTorch CUDA build": str(torch.version.cuda or "no (CPU build)"),
            "PyTorch distributed": f"gloo={torch.distributed.is_gloo_available()}, "
                                   f"nccl={torch.distributed.is_nccl_available()}"
                                   if torch.distributed.is_available() else "not available"}
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    info["GPUs"] = str(count)
    for index in range(count):
        props = torch.cuda.get_device_properties(index)
        info[f"GPU {index}"] = f"{props.name}, {props.total_memory / 2**30:.1f} GiB"
    return info


def collect_environment(config_file: str | None = None) -> dict[str, Any]:
    """Everything ``hasten env`` prints, as an ordered dict.

    Example:
        >>> "Python version" in collect_environment()  # doctest: +SKIP
        True
    """
    import psutil

    info: dict[str, Any] = {
        "hasten version": _version("hasten"),
        "Platform": platform.platform(),
        "`hasten` executable": shutil.which("hasten") or "not on PATH",
        "Python version": platform.python_version(),
        "NumPy version": _version("numpy"),
    }
    info.update(_torch_info())
    info["CPU count"] = str(os.cpu_count())
    info["RAM"] = f"{psutil.virtual_memory().total / 2**30:.2f} GiB"
    info.update({f"{name} version": _version(name) for name in OPTIONAL_PACKAGES})
    info["Config file"] = _config_summary(config_file)
    return info


def _config_summary(config_file: str | None) -> Any:
    from hasten.config.io import find_config_file, is_accelerate_config, load_config_file
    from hasten.exceptions import ConfigurationError

    try:
        path = find_config_file(config_file)
        if path is None:
            return "not found (run `hasten config`)"
        source = {"source": "Accelerate's default configuration file"} if is_accelerate_config(path) else {}
        return {"path": str(path), **source, **load_config_file(path).to_dict()}
    except ConfigurationError as exc:
        return f"invalid: {exc}"


def env_command(args: argparse.Namespace) -> int:
    """Print the report."""
    info = collect_environment(args.config_file)
    print("\nCopy-and-paste the text below in your GitHub issue\n")
    for key, value in info.items():
        if isinstance(value, dict):
            print(f"- {key}:")
            for sub_key, sub_value in value.items():
                print(f"\t- {sub_key}: {sub_value}")
        else:
            print(f"- {key}: {value}")
    sys.stdout.flush()
    return 0


def main(argv: list[str] | None = None) -> int:
    """This command on its own (Accelerate's ``accelerate.commands.env.main``)."""
    args = env_command_parser().parse_args(argv)
    return int(args.func(args) or 0)

# Names Accelerate's module at this path shows but defines elsewhere (hasten/_accelerate_shown.py).
__getattr__ = accelerate_path_getattr(__name__, globals())
