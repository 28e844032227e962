"""The rest of Accelerate's ``accelerate.commands.launch`` module: its per-platform launcher entry points
and help helpers.

hasten has one launcher path (``launch_command``: a validated plan, then torchrun's agent or one process),
so ``simple_launcher``, ``multi_gpu_launcher`` and ``deepspeed_launcher`` all run it; TPU and SageMaker
launchers are refused (:mod:`hasten.base.unsupported`).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

#: Accelerate's launch options that select a platform, and the help group each one shows.
options_to_group = {"multi_gpu": "Distributed GPUs", "tpu": "TPU", "use_deepspeed": "DeepSpeed Arguments",
                    "use_fsdp": "FSDP Arguments", "use_megatron_lm": "Megatron-LM Arguments",
                    "fp8_backend": "FP8 Arguments"}


def clean_option(option: str) -> str | None:
    """``--some-flag`` -> ``some_flag`` (None for a value that is not a long option)."""
    if "fp8_backend" in option:
        option = "--fp8_backend"
    return option[2:].replace("-", "_") if option.startswith("--") else None


class CustomHelpFormatter(argparse.HelpFormatter):
    """A help formatter that shows a platform's option group only when that platform's flag (see
    ``options_to_group``) is on the command line, and lists only the underscore spelling of options."""

    def add_argument(self, action: argparse.Action) -> None:
        args = [clean_option(a) for a in sys.argv[1:]]
        shown = {options_to_group[a] for a in args if a in options_to_group}
        title = getattr(getattr(action, "container", None), "title", None)
        if title in options_to_group.values() and title not in shown:
            action.help = argparse.SUPPRESS
        action.option_strings = [s for s in action.option_strings if "-" not in s[2:]]
        super().add_argument(action)


def _run(args: argparse.Namespace) -> None:
    from hasten.commands.launch import launch_command

    code = launch_command(args)
    if code != 0:
        if getattr(args, "quiet", False):
            sys.exit(1)
        raise subprocess.CalledProcessError(returncode=code, cmd=[str(getattr(args, "training_script", ""))])


def simple_launcher(args: argparse.Namespace) -> None:
    """Launch ``args`` (a parsed ``launch_command_parser()`` namespace); a failure raises
    ``CalledProcessError`` (exit 1 with ``--quiet``), as Accelerate's does."""
    _run(args)


def multi_gpu_launcher(args: argparse.Namespace) -> None:
    """As :func:`simple_launcher`: hasten's one launch path starts every process count through torchrun."""
    _run(args)


def deepspeed_launcher(args: argparse.Namespace) -> None:
    """As :func:`simple_launcher`: DeepSpeed runs start through the same path (DeepSpeed settings in ``args``)."""
    _run(args)
