"""Rank-aware logging: ``get_logger(__name__)`` logs once (main process) unless told otherwise.

Example:
    >>> logger = get_logger(__name__, log_level="INFO")
    >>> logger.info("seen once")
    >>> logger.info("seen on every rank", main_process_only=False)
    >>> logger.info("every rank, in rank order", main_process_only=False, in_order=True)
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

from hasten.config.env import log_level as env_log_level


class MultiProcessAdapter(logging.LoggerAdapter):  # type: ignore[type-arg]
    """A logger adapter whose calls accept ``main_process_only`` and ``in_order``; records carry the rank."""

    @staticmethod
    def _should_log(main_process_only: bool) -> bool:
        from hasten.state import PartialState

        state = PartialState()
        return not main_process_only or state.is_main_process

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        from hasten.state import PartialState

        if not PartialState._shared_state:
            raise RuntimeError("You must initialize the hasten state by calling either `PartialState()` or "
                               "`Accelerator()` before using the logging utility.")
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        kwargs.setdefault("stacklevel", 2)
        if not self.isEnabledFor(level):
            return
        state = PartialState()
        if self._should_log(main_process_only):
            msg, kwargs = self.process(msg, kwargs)
            self.logger.log(level, msg, *args, **kwargs)
        elif in_order:
            for i in range(state.num_processes):
                if i == state.process_index:
                    msg, kwargs = self.process(msg, kwargs)
                    self.logger.log(level, msg, *args, **kwargs)
                state.wait_for_everyone()

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        from hasten.state import PartialState

        state = PartialState()
        extra = dict(kwargs.get("extra") or {})
        extra.setdefault("rank", state.process_index)
        kwargs["extra"] = extra
        prefix = f"[RANK {state.process_index}] " if state.num_processes > 1 else ""
        return f"{prefix}{msg}", kwargs

    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        """Log a warning only the first time this exact message is seen."""
        key = (args, tuple(sorted(kwargs.items())))
        seen = self.__dict__.setdefault("_seen", set())
        if key not in seen:
            seen.add(key)
            self.warning(*args, **kwargs)


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """A logger whose messages appear on the main process only unless ``main_process_only=False``.

    Args:
        name: the logger's name, usually ``__name__``.
        log_level: e.g. ``"INFO"``; defaults to ``HASTEN_LOG_LEVEL`` when set.
    """
    level = log_level or env_log_level()
    logger = logging.getLogger(name)
    if level is not None:
        logger.setLevel(level.upper())
        logger.root.setLevel(level.upper())
    return MultiProcessAdapter(logger, {})
