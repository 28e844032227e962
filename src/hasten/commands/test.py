"""``hasten test``: launch the packaged check script (``test_utils/scripts/test_script.py``) with the configured
processes."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from hasten._lazy import accelerate_path_getattr


def sanity_script() -> Path:
    """Path of the packaged check script, ``hasten/test_utils/scripts/test_script.py`` (Accelerate's
    ``accelerate test`` runs its ``test_script.py`` the same way)."""
    return Path(__file__).resolve().parents[1] / "test_utils" / "scripts" / "test_script.py"


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``hasten test``."""
    parser = subparsers.add_parser("test", help="Check that the distributed set-up works.",
                                   description="Run hasten's sanity checks through `hasten launch` with the "
                                               "configuration file's settings.")
    parser.add_argument("--config_file", "--config-file", default=None, help="Configuration file to use.")
    parser.add_argument("--cpu", action="store_true", help="Run the checks on CPU (hasten extension).")
    parser.add_argument("--num_processes", "--num-processes", type=int, default=None,
                        help="Override the number of processes (hasten extension).")
    parser.set_defaults(func=test_command)
    return parser


def test_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """Accelerate's name: the ``test`` parser, added to ``subparsers`` or standalone."""
    from hasten.commands.main import standalone_parser

    return standalone_parser(register, subparsers)


def test_command(args: argparse.Namespace) -> int:
    """Launch the sanity script; its last line is the success message, or a check's failure."""
    from hasten.commands.launch import build_launch_parser, launch_command

    argv: list[str] = []
    if args.config_file:
        argv += ["--config_file", args.config_file]
    if args.cpu:
        argv.append("--cpu")
    if args.num_processes is not None:
        argv += ["--num_processes", str(args.num_processes)]
    launch_args = build_launch_parser(argparse.ArgumentParser("hasten test")).parse_args([*argv, str(sanity_script())])
    code = launch_command(launch_args)
    if code != 0:
        print(f"hasten test: the checks failed (exit code {code}); see the failing check above.")
    return code


def main(argv: list[str] | None = None) -> int:
    """This command on its own (Accelerate's ``accelerate.commands.test.main``)."""
    args = test_command_parser().parse_args(argv)
    return int(args.func(args) or 0)

# Names Accelerate's module at this path shows but defines elsewhere (hasten/_accelerate_shown.py).
__getattr__ = accelerate_path_getattr(__name__, globals())
