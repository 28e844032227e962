"""mkdocs hook: expand ``<!-- hasten-cli-help -->`` into the help text of ``hasten`` and each subcommand.

The text comes from the real argument parsers (``hasten.commands.main.build_parser``), so the CLI page
cannot drift from the code. The width is fixed so that the page does not depend on the terminal.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

MARKER = "<!-- hasten-cli-help -->"
WIDTH = "80"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps subcommands in a private action; no public accessor
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _describe(parser: argparse.ArgumentParser, command: str, parts: list[str]) -> None:
    """Append ``command``'s help, then its subcommands' (``hasten config default`` ...), depth first."""
    level = "##" if command.count(" ") <= 1 else "###"
    parts += [f"{level} {command}", "", "```text", parser.format_help().rstrip(), "```", ""]
    for name, sub in _subparsers(parser).items():
        _describe(sub, f"{command} {name}", parts)


def cli_reference() -> str:
    """Markdown with ``hasten --help`` followed by one section per subcommand."""
    from hasten.commands.main import build_parser

    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH  # argparse reads the width from COLUMNS
    try:
        parts: list[str] = []
        _describe(build_parser(), "hasten", parts)
    finally:
        if previous is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = previous
    return "\n".join(parts)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    """mkdocs event: replace the marker on the page that holds it."""
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, cli_reference())
