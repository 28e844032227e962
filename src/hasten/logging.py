"""Rank-aware logging: ``get_logger(__name__)`` logs once (on the main process) unless told otherwise,
and ``tqdm`` draws one progress bar per machine.

Every record carries the rank of the process that wrote it (``record.rank``, usable in a format string
as ``%(rank)s``), and with several processes the message is prefixed by ``[RANK i]``. The level can be
set for all hasten-style loggers with ``HASTEN_LOG_LEVEL`` (e.g. ``HASTEN_LOG_LEVEL=INFO``).

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

from hasten._lazy import accelerate_path_getattr
from hasten.config.env import log_level as env_log_level


def _state() -> Any:
    from hasten.state import PartialState

    if not PartialState._shared_state:
        raise RuntimeError("You must initialize the hasten state by calling either `PartialState()` or "
                           "`Accelerator()` before using the logging utility.")
    return PartialState()


class MultiProcessAdapter(logging.LoggerAdapter):  # type: ignore[type-arg]
    """A logger adapter whose calls accept ``main_process_only`` (default True) and ``in_order`` (default False).

    - ``main_process_only=True``: only the main process (global rank 0) emits the record.
    - ``main_process_only=False``: every process emits it.
    - ``main_process_only=False, in_order=True``: every process emits it, rank 0 first, then rank 1, ...
      This is a collective (processes wait for each other): every process must make the call. Accelerate
      accepts the flag but prints in arbitrary order in that case; hasten orders the output.
    """

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        state = _state()
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        # Report the caller of logger.info(...)/logger.log(...), not this adapter.
        kwargs.setdefault("stacklevel", 2)
        if not self.isEnabledFor(level):
            return
        if main_process_only:
            if state.is_main_process:
                self._emit(level, msg, args, kwargs)
            return
        if not in_order or state.num_processes == 1:
            self._emit(level, msg, args, kwargs)
            return
        for rank in range(state.num_processes):
            if rank == state.process_index:
                self._emit(level, msg, args, kwargs)
                for handler in _handlers(self.logger):
                    handler.flush()  # the output must leave this process before the next rank writes
            state.wait_for_everyone()

    def _emit(self, level: int, msg: Any, args: tuple[Any, ...], kwargs: MutableMapping[str, Any]) -> None:
        msg, kwargs = self.process(msg, kwargs)
        # +1: this helper adds a frame between the caller and Logger.log
        kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 1
        self.logger.log(level, msg, *args, **kwargs)

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        """Add ``rank`` to the record's ``extra`` and prefix ``[RANK i]`` when there are several processes."""
        state = _state()
        extra = dict(self.extra or {})
        extra.update(kwargs.get("extra") or {})
        extra.setdefault("rank", state.process_index)
        kwargs["extra"] = extra
        if state.num_processes > 1:
            msg = f"[RANK {state.process_index}] {msg}"
        return msg, kwargs

    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        """Log a warning only the first time this exact message (and options) is seen by this logger."""
        key = repr((args, sorted(kwargs.items())))
        seen = self.__dict__.setdefault("_seen", set())
        if key not in seen:
            seen.add(key)
            kwargs.setdefault("stacklevel", 2)
            kwargs["stacklevel"] += 1
            self.warning(*args, **kwargs)


def _handlers(logger: logging.Logger) -> list[logging.Handler]:
    handlers: list[logging.Handler] = []
    current: logging.Logger | None = logger
    while current is not None:
        handlers.extend(current.handlers)
        current = current.parent if current.propagate else None
    if not handlers and logging.lastResort is not None:
        handlers.append(logging.lastResort)
    return handlers


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """A logger whose messages appear on the main process only unless ``main_process_only=False``.

    Args:
        name: the logger's name, usually ``__name__``.
        log_level: e.g. ``"INFO"``; defaults to ``HASTEN_LOG_LEVEL`` when that is set. As in Accelerate,
            a level given here (or by the variable) is also set on the root logger.

    Example:
        >>> logger = get_logger(__name__, log_level="INFO")
        >>> logger.info("loss %.3f", 0.25)                                   # main process only
        >>> logger.warning("rank-local note", main_process_only=False)        # every process
    """
    level = log_level or env_log_level()
    logger = logging.getLogger(name)
    if level is not None:
        logger.setLevel(level.upper())
        logger.root.setLevel(level.upper())
    return MultiProcessAdapter(logger, {})


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """A ``tqdm.auto.tqdm`` bar, shown on the local main process only unless ``main_process_only=False``.

    Arguments are ``tqdm``'s. On the other processes the bar is created with ``disable=True``, so it
    still iterates (and ``update``/``close`` work) but draws nothing.

    Raises:
        ValueError: a bool was passed as the first argument (the old positional ``main_process_only``
            of Accelerate); pass ``main_process_only=...`` by keyword.

    Example:
        >>> for batch in tqdm(dataloader, desc="train"):
        ...     ...
    """
    if args and isinstance(args[0], bool):
        raise ValueError("tqdm(True/False, ...) is not supported: pass `main_process_only=` as a keyword "
                         "argument and the iterable first, e.g. tqdm(loader, main_process_only=True).")
    from tqdm.auto import tqdm as _tqdm

    from hasten.state import PartialState

    disable = kwargs.pop("disable", False)
    if main_process_only and not disable:
        disable = PartialState().local_process_index != 0
    return _tqdm(*args, **kwargs, disable=disable)

# Names Accelerate's module at this path shows but defines elsewhere (hasten/_accelerate_shown.py).
__getattr__ = accelerate_path_getattr(__name__, globals())
