"""Which trackers exist, which are installed, and ``filter_trackers`` (turns ``log_with`` into a checked list)."""

from __future__ import annotations

import importlib.util
import os
import warnings
from typing import Any

from hasten.base.dataclasses import LoggerType
from hasten.exceptions import ConfigurationError, MissingDependencyError
from hasten.tracking._clearml_comet import ClearMLTracker, CometMLTracker
from hasten.tracking._local_trackers import AimTracker, DVCLiveTracker, SwanLabTracker, TrackioTracker
from hasten.tracking._mlflow import MLflowTracker
from hasten.tracking._tensorboard import TensorBoardTracker
from hasten.tracking._wandb import WandBTracker
from hasten.tracking.base import GeneralTracker
from hasten.tracking.jsonl import JSONLTracker

#: Built-in tracker classes by ``LoggerType`` value (``register_tracker_class`` adds more).
LOGGER_TYPE_TO_CLASS: dict[str, type[GeneralTracker]] = {
    "jsonl": JSONLTracker,
    "tensorboard": TensorBoardTracker,
    "wandb": WandBTracker,
    "mlflow": MLflowTracker,
    "comet_ml": CometMLTracker,
    "aim": AimTracker,
    "clearml": ClearMLTracker,
    "dvclive": DVCLiveTracker,
    "swanlab": SwanLabTracker,
    "trackio": TrackioTracker,
}

# The importable module(s) each built-in tracker needs (any one of them), and the pip extra providing it.
_REQUIREMENTS: dict[str, tuple[tuple[str, ...], str | None]] = {
    "jsonl": ((), None),
    "tensorboard": (("tensorboard", "tensorboardX"), "tensorboard"),
    "wandb": (("wandb",), "wandb"),
    "mlflow": (("mlflow",), "mlflow"),
    "comet_ml": (("comet_ml",), "comet_ml"),
    "aim": (("aim",), "aim"),
    "clearml": (("clearml",), "clearml"),
    "dvclive": (("dvclive",), "dvclive"),
    "swanlab": (("swanlab",), "swanlab"),
    "trackio": (("trackio",), "trackio"),
}


def register_tracker_class(tracker_class: type[GeneralTracker]) -> type[GeneralTracker]:
    """Make a tracker class selectable by name: ``log_with="<cls.name>"`` (usable as a class decorator).

    The class is built like the built-ins: ``cls(project_name, logging_dir, **init_kwargs)`` when it
    ``requires_logging_directory``, else ``cls(project_name, **init_kwargs)``.

    Example:
        >>> @register_tracker_class
        ... class CSVTracker(GeneralTracker):
        ...     name = "csv"
        ...     requires_logging_directory = True
        ...     ...
        >>> Accelerator(log_with="csv", project_dir="runs")
    """
    cls = tracker_class
    if not (isinstance(cls, type) and issubclass(cls, GeneralTracker)):
        raise TypeError(f"register_tracker_class needs a GeneralTracker subclass, got {cls!r}")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{cls.__name__} needs a `name` class attribute (a non-empty string) to be registered")
    if name == "all":  # log_with="all" means every available tracker: the name cannot be a tracker's
        raise ValueError(f"the tracker name 'all' is reserved (log_with='all'); give {cls.__name__} another `name`")
    if name in LOGGER_TYPE_TO_CLASS and LOGGER_TYPE_TO_CLASS[name] is not cls:
        warnings.warn(f"A tracker with the name '{name}' is already registered and will be overwritten by {cls}. "
                      "This is especially significant when shadowing a built-in tracker.", stacklevel=2)
    LOGGER_TYPE_TO_CLASS[name] = cls
    return cls


def is_tracker_available(name: str) -> bool:
    """True when the tracker ``name`` is known and the package it needs is installed."""
    if name not in LOGGER_TYPE_TO_CLASS:
        return False
    modules, _ = _REQUIREMENTS.get(name, ((), None))
    return not modules or any(importlib.util.find_spec(module) is not None for module in modules)


def get_available_trackers() -> list[LoggerType | str]:
    """The trackers usable here (their package is installed), e.g. ``[LoggerType.JSONL, LoggerType.MLFLOW]``.

    Example:
        >>> LoggerType.JSONL in get_available_trackers()
        True
    """
    return [_as_logger_type(name) for name in LOGGER_TYPE_TO_CLASS if is_tracker_available(name)]


def _as_logger_type(name: str) -> LoggerType | str:
    try:
        return LoggerType(name)
    except ValueError:
        return name  # a registered custom class


def _tracker_name(entry: Any) -> str:
    if isinstance(entry, LoggerType):
        return entry.value
    if isinstance(entry, str):
        return entry.strip().lower()
    if isinstance(entry, type) and issubclass(entry, GeneralTracker):
        raise TypeError(f"log_with holds the class {entry.__name__}: pass an instance, e.g. "
                        f"log_with=[{entry.__name__}(...)], or register it with register_tracker_class.")
    raise TypeError(f"log_with entries must be tracker names, LoggerType values or GeneralTracker instances, "
                    f"got {entry!r} ({type(entry).__name__})")


def _check_named(name: str, logging_dir: Any) -> None:
    if name not in LOGGER_TYPE_TO_CLASS:
        known = ", ".join(repr(n) for n in ["all", *LOGGER_TYPE_TO_CLASS])
        if name in LoggerType.list():
            raise ConfigurationError(
                f"log_with={name!r}: hasten has no built-in {name} tracker yet (built in: {known}). Write a "
                f"GeneralTracker subclass for it and pass an instance: log_with=[My{name.title()}Tracker()].")
        raise ConfigurationError(f"log_with={name!r} is not a known tracker; choose from {known}, or pass a "
                                 "GeneralTracker instance.")
    if not is_tracker_available(name):
        modules, extra = _REQUIREMENTS[name]
        raise MissingDependencyError(modules[0], f"log_with={name!r}", extra=extra)
    if LOGGER_TYPE_TO_CLASS[name].requires_logging_directory and logging_dir is None:
        raise ConfigurationError(f"Logging with `{name}` requires a `logging_dir` to be passed in. "  # Accelerate's
                                 f"log_with={name!r} writes files and needs a logging directory: pass "
                                 "Accelerator(project_dir=...) or ProjectConfiguration(logging_dir=...).")


def filter_trackers(log_with: Any, logging_dir: str | os.PathLike[str] | None = None) -> list[Any]:
    """Check ``log_with`` and return the trackers to start: ``LoggerType`` values and tracker instances.

    ``"all"`` means every installed built-in tracker (trackers that need a logging directory are left out,
    with a warning, when ``logging_dir`` is None) plus any instance given alongside. Names are matched
    case-insensitively and duplicates dropped.

    Unlike Accelerate, which silently drops a named tracker whose package is missing, an explicitly
    named tracker must be usable.

    Raises:
        ConfigurationError: an unknown name (the message lists the available ones), or a tracker that
            writes files while ``logging_dir`` is None.
        MissingDependencyError: a named tracker's package is not installed (the message has the pip command).
        TypeError: an entry is neither a name nor a ``GeneralTracker`` instance.

    Example:
        >>> filter_trackers(["tensorboard", "jsonl"], logging_dir="runs")
        [<LoggerType.TENSORBOARD: 'tensorboard'>, <LoggerType.JSONL: 'jsonl'>]
    """
    if log_with is None:
        return []
    entries = list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
    chosen: list[Any] = []
    names: list[str] = []
    want_all = False
    for entry in entries:
        if isinstance(entry, GeneralTracker):
            if not any(entry is other for other in chosen):
                chosen.append(entry)
            continue
        name = _tracker_name(entry)
        if name == "all":
            want_all = True
            continue
        _check_named(name, logging_dir)
        if name not in names:
            names.append(name)
            chosen.append(_as_logger_type(name))
    if want_all:
        skipped = []
        for name in LOGGER_TYPE_TO_CLASS:
            if name in names or not is_tracker_available(name):
                continue
            if LOGGER_TYPE_TO_CLASS[name].requires_logging_directory and logging_dir is None:
                skipped.append(name)
                continue
            names.append(name)
            chosen.append(_as_logger_type(name))
        if skipped:
            warnings.warn(f"log_with='all' left out {skipped}: they write files and no logging directory was "
                          "given (pass Accelerator(project_dir=...)).", UserWarning, stacklevel=2)
    return chosen
