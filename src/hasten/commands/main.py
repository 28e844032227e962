"""``hasten`` entry point: one argparse root, each subcommand module exposes ``register(subparsers)``."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

# Subcommand modules are imported only when present, so the CLI grows with the library.
SUBCOMMANDS = ("config", "launch", "test", "env", "estimate_memory", "merge_weights", "to_fsdp2", "tpu")


def standalone_parser(register: Any, subparsers: Any = None) -> argparse.ArgumentParser:
    """Accelerate's ``*_command_parser(subparsers=None)`` convention: add the subcommand to ``subparsers``,
    or, without them, return it as a parser of its own (``hasten <command>``)."""
    if subparsers is None:
        subparsers = argparse.ArgumentParser("hasten").add_subparsers(prog="hasten")
    return register(subparsers)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser("hasten", usage="hasten <command> [<args>]",
                                     description="Run PyTorch training on any hardware with one loop.")
    subparsers = parser.add_subparsers(dest="command", metavar="<command>", prog="hasten")
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"hasten.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"hasten.commands.{name}":
                continue
            raise
        module.register(subparsers)
    return parser


def _unknown_options_message(parser: argparse.ArgumentParser, command: str | None, unknown: list[str]) -> str:
    import difflib

    options: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            options = [o for a in action.choices[command]._actions for o in a.option_strings]
    parts = []
    for item in unknown:
        guess = difflib.get_close_matches(item.split("=")[0], options, n=1) if item.startswith("-") else []
        parts.append(f"{item} (did you mean {guess[0]}?)" if guess else item)
    return f"hasten {command or ''}: error: unrecognized arguments: {' '.join(parts)}".replace("  ", " ")


def main(argv: list[str] | None = None) -> int:
    """Run the ``hasten`` command line (unknown options fail with a did-you-mean, exit status 2)."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        print(_unknown_options_message(parser, getattr(args, "command", None), unknown), file=sys.stderr)
        return 2
    if not hasattr(args, "func"):
        parser.print_help()
        return 1
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
