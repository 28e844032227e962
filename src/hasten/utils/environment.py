"""Small helpers around environment variables (one of the few places allowed to touch ``os.environ``)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

_TRUE = {"1", "true", "yes", "y", "on", "t"}
_FALSE = {"0", "false", "no", "n", "off", "f", ""}


def str_to_bool(value: str) -> int:
    """Convert a truthy/falsy string to 1 or 0, as Accelerate does.

    Example:
        >>> str_to_bool("yes")
        1

    Raises:
        ValueError: the string is neither truthy nor falsy.
    """
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return 1
    if lowered in _FALSE:
        return 0
    raise ValueError(f"invalid truth value {value!r}: use one of {sorted(_TRUE | _FALSE - {''})}")


def parse_flag_from_env(key: str, default: bool = False, env: Mapping[str, str] | None = None) -> bool:
    """Read a boolean flag from ``env`` (``os.environ`` by default)."""
    env = os.environ if env is None else env
    value = env.get(key)
    return default if value is None else bool(str_to_bool(value))


def get_int_from_env(env_keys: list[str], default: int, env: Mapping[str, str] | None = None) -> int:
    """Return the first non-negative integer found under ``env_keys``, else ``default``."""
    env = os.environ if env is None else env
    for key in env_keys:
        value = int(env.get(key, -1))
        if value >= 0:
            return value
    return default


@contextmanager
def patch_environment(**kwargs: Any) -> Iterator[None]:
    """Temporarily set environment variables (keys are upper-cased), restoring them on exit.

    Example:
        >>> with patch_environment(master_port="29501"):
        ...     pass
    """
    saved: dict[str, str | None] = {}
    for key, value in kwargs.items():
        key = key.upper()
        saved[key] = os.environ.get(key)
        os.environ[key] = str(value)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def current_environment() -> Mapping[str, str]:
    """The process environment, for code that must pass an env mapping to pure functions."""
    return os.environ


def is_env_set(key: str) -> bool:
    """True when the variable ``key`` is present in this process's environment."""
    return key in os.environ
