"""``hasten tpu-config``: Accelerate's command that runs setup commands on every TPU-pod worker.

hasten has no TPU engine, so the command accepts Accelerate's options (a script written for
``accelerate tpu-config`` parses) and then explains, with exit status 2, what to use instead.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from hasten._lazy import accelerate_path_getattr
from hasten.base.refusals import TPU, refusal

__all__ = ["register", "tpu_command_launcher", "tpu_command_parser"]


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``tpu-config`` (Accelerate's options)."""
    parser = subparsers.add_parser("tpu-config", help="Not supported: TPU pods (explains the alternative).",
                                   description=__doc__.split("\n\n")[1])
    parser.add_argument("--config_file", "--config-file", default=None, help="Configuration file.")
    parser.add_argument("--tpu_name", "--tpu-name", default=None, help="The TPU pod's name.")
    parser.add_argument("--tpu_zone", "--tpu-zone", default=None, help="The TPU pod's zone.")
    parser.add_argument("--use_alpha", "--use-alpha", action="store_true", help="Use gcloud alpha.")
    parser.add_argument("--command_file", "--command-file", default=None, help="File of commands to run.")
    parser.add_argument("--command", action="append", nargs="+", help="A command to run on every worker.")
    parser.add_argument("--install_accelerate", "--install-accelerate", action="store_true",
                        help="Install Accelerate on the workers.")
    parser.add_argument("--accelerate_version", "--accelerate-version", default="latest", help="Its version.")
    parser.add_argument("--debug", action="store_true", help="Print the gcloud command instead of running it.")
    parser.set_defaults(func=tpu_command_launcher)
    return parser


def tpu_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The ``tpu-config`` parser, added to ``subparsers`` or standalone."""
    from hasten.commands.main import standalone_parser

    return standalone_parser(register, subparsers)


def tpu_command_launcher(args: argparse.Namespace) -> int:
    """Refuse: print why and what to use instead; exit status 2."""
    print(f"hasten tpu-config: error: {refusal('tpu-config', TPU)}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """This command on its own (Accelerate's ``accelerate.commands.tpu.main``)."""
    args = tpu_command_parser().parse_args(argv)
    return int(args.func(args) or 0)

# Names Accelerate's module at this path shows but defines elsewhere (hasten/_accelerate_shown.py).
__getattr__ = accelerate_path_getattr(__name__, globals())
