"""Accelerate's ``accelerate.commands.utils``: an ``argparse`` parser for commands built on Accelerate's CLI.

``CustomArgumentParser`` (and the groups it makes) accepts every long option spelled with ``_`` or ``-``
between words (``--num_processes`` and ``--num-processes``), and records in ``namespace.nondefault`` the
destinations the command line set, so a caller can tell a typed value from a default. Other tools build
their launch parsers on it; hasten's own CLI does the same through its flag table.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any


def _with_dashed_spellings(option_strings: Sequence[str]) -> list[str]:
    """``["--num_processes"]`` -> ``["--num_processes", "--num-processes"]`` (short options unchanged)."""
    spellings: list[str] = []
    for option in option_strings:
        spellings.append(option)
        if option.startswith("--") and "_" in option[2:]:
            spellings.append("--" + option[2:].replace("_", "-"))
    return spellings


def _record_set(namespace: argparse.Namespace, dest: str) -> None:
    if not hasattr(namespace, "nondefault"):
        namespace.nondefault = set()
    namespace.nondefault.add(dest)


class _StoreAction(argparse.Action):
    """``store``, under both spellings of the option, noting the destination in ``nondefault``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.option_strings = _with_dashed_spellings(self.option_strings)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        _record_set(namespace, self.dest)


class _StoreConstAction(_StoreAction):
    """``store_const`` with the behaviour of :class:`_StoreAction`."""

    def __init__(self, option_strings: Sequence[str], dest: str, const: Any, default: Any = None,
                 required: bool = False, help: str | None = None) -> None:  # noqa: A002 - argparse's name
        super().__init__(option_strings=option_strings, dest=dest, nargs=0, const=const, default=default,
                         required=required, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        super().__call__(parser, namespace, self.const, option_string)


class _StoreTrueAction(_StoreConstAction):
    """``store_true`` with the behaviour of :class:`_StoreAction`."""

    def __init__(self, option_strings: Sequence[str], dest: str, default: Any = None, required: bool = False,
                 help: str | None = None) -> None:  # noqa: A002 - argparse's name
        super().__init__(option_strings, dest, const=True, default=default, required=required, help=help)


def _converted(action: argparse.Action) -> argparse.Action:
    """``action`` as the matching action above (argparse's store / store_const / store_true), else itself."""
    if isinstance(action, argparse._StoreTrueAction):
        return _StoreTrueAction(action.option_strings, action.dest, action.default, action.required, action.help)
    if isinstance(action, argparse._StoreConstAction):
        return _StoreConstAction(action.option_strings, action.dest, action.const, action.default, action.required,
                                 action.help)
    if type(action) is argparse._StoreAction:
        return _StoreAction(**vars(action))
    return action


class CustomArgumentGroup(argparse._ArgumentGroup):
    """An argument group whose options take both spellings and are noted in ``nondefault`` when set."""

    # typeshed ties the returned action's type to the argument's; this one returns the converted action.
    def _add_action(self, action: argparse.Action) -> argparse.Action:  # type: ignore[override]
        return super()._add_action(_converted(action))


class CustomArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose options take both spellings (``--num_processes`` / ``--num-processes``)
    and are noted in ``namespace.nondefault`` when the command line sets them.

    Example:
        >>> parser = CustomArgumentParser()
        >>> parser.add_argument("--num_processes", type=int)
        >>> parser.parse_args(["--num-processes", "2"]).nondefault
        {'num_processes'}
    """

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:  # type: ignore[override]
        if "action" not in kwargs:
            kwargs["action"] = _StoreAction
        elif kwargs["action"] == "store_true":
            kwargs["action"] = _StoreTrueAction
        return super().add_argument(*args, **kwargs)

    def add_argument_group(self, *args: Any, **kwargs: Any) -> CustomArgumentGroup:  # type: ignore[override]
        group = CustomArgumentGroup(self, *args, **kwargs)
        self._action_groups.append(group)
        return group
