"""``GeneralTracker``, the base of every experiment tracker, and the helpers the built-in ones share."""

from __future__ import annotations

import functools
import json
import numbers
import os
import tempfile
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

_F = TypeVar("_F", bound=Callable[..., Any])


def on_main_process(function: _F) -> _F:
    """Decorator for tracker methods: run only on the main process when ``self.main_process_only`` is True.

    The check happens at call time, so defining or constructing a tracker never creates the shared
    process state (``InitProcessGroupKwargs`` must be able to act first). Without distribution every
    call runs.

    Example:
        >>> class MyTracker(GeneralTracker):
        ...     @on_main_process
        ...     def log(self, values, step=None, **kwargs): ...
    """

    @functools.wraps(function)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "main_process_only", False):
            from hasten.state import PartialState

            if not PartialState().is_main_process:
                return None
        return function(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _do_nothing(*args: Any, **kwargs: Any) -> None:
    return None


class GeneralTracker:
    """Base class of experiment trackers; subclass it to plug in your own (pass an instance in ``log_with``).

    A subclass defines ``name`` (str), ``requires_logging_directory`` (bool) and a ``tracker`` property
    (the underlying run or writer object), and overrides what it needs of ``start``,
    ``store_init_configuration``, ``log`` and ``finish``. ``main_process_only`` (default True) says
    whether the tracker lives on the main process only; a tracker with ``main_process_only = False`` is
    started, fed and finished on every process.

    ``GeneralTracker(_blank=True)`` is the stand-in that ``Accelerator.get_tracker`` returns on processes
    that hold no tracker: any method called on it does nothing (``log_images``, ``log_table``...), and
    its ``tracker`` is None.

    Example:
        >>> class PrintTracker(GeneralTracker):
        ...     name = "print"
        ...     requires_logging_directory = False
        ...     def __init__(self):
        ...         super().__init__()
        ...     @property
        ...     def tracker(self):
        ...         return None
        ...     def log(self, values, step=None, **kwargs):
        ...         print(step, values)
        >>> accelerator = Accelerator(log_with=PrintTracker())
    """

    main_process_only = True
    #: Declared here, defined by every concrete tracker class (checked in ``__init__``).
    name: str
    requires_logging_directory: bool

    def __init__(self, _blank: bool = False) -> None:
        self._blank = _blank
        if _blank:
            return
        missing = [attr for attr in ("name", "requires_logging_directory") if not hasattr(self, attr)]
        if "tracker" not in dir(self):
            missing.append("tracker")
        if missing:
            raise NotImplementedError(
                f"{type(self).__name__} is missing the required tracker attributes {', '.join(missing)}: define "
                "`name` (str) and `requires_logging_directory` (bool) as class attributes and `tracker` as a "
                "property returning the underlying run/writer object.")

    def __getattr__(self, attr: str) -> Any:
        # Only reached for attributes that do not exist; a blank tracker swallows every method call so that
        # code written for the main process (``get_tracker(...).log_images(...)``) runs unchanged elsewhere.
        if self.__dict__.get("_blank") and not attr.startswith("_"):
            return None if attr == "tracker" else _do_nothing
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {attr!r}")

    def start(self) -> None:
        """Create the underlying run (called by ``Accelerator.init_trackers``, after the process state exists)."""

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Record the run's hyperparameters (``config`` of ``init_trackers``)."""

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Record ``values`` (name -> number, text, or dict of numbers) at ``step``."""

    def finish(self) -> None:
        """Flush and close the run (called by ``Accelerator.end_training``)."""

    def __repr__(self) -> str:
        if self.__dict__.get("_blank"):
            return "GeneralTracker(_blank=True)"
        return f"{type(self).__name__}(name={getattr(self, 'name', '?')!r})"


# ------------------------------------------------------------------------------------- value helpers
def as_python_scalar(value: Any) -> Any:
    """Turn one-element tensors and numpy scalars/0-d arrays into Python numbers; leave the rest alone."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    item = getattr(value, "item", None)
    numel = getattr(value, "numel", None)
    size = getattr(value, "size", None)
    if callable(item):
        if callable(numel) and numel() == 1:  # torch.Tensor
            return value.item()
        if isinstance(size, int) and size == 1:  # numpy scalar or one-element array
            return value.item()
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):  # Decimal, Fraction...: JSON and the tracker libraries want floats
        return float(value)
    return value


def is_number(value: Any) -> bool:
    """True for real numbers (bool included), False for text and containers."""
    return isinstance(value, numbers.Real)


def scalar_items(values: Mapping[str, Any], tracker: str, allow_text: bool = True) -> dict[str, Any]:
    """Check ``values`` for a tracker that takes numbers, text and one level of dicts of numbers.

    Returns a copy with tensors/numpy scalars converted to Python numbers.

    Raises:
        TypeError: a key is not a string, or a value has a type the tracker cannot record (the message
            names the key, the type and what to log instead).
    """
    if not isinstance(values, Mapping):
        raise TypeError(f"{tracker}: `values` must be a dict of name -> value, got {type(values).__name__}")
    out: dict[str, Any] = {}
    for key, raw in values.items():
        if not isinstance(key, str):
            raise TypeError(f"{tracker}: metric names must be strings, got {key!r} ({type(key).__name__})")
        value = as_python_scalar(raw)
        if isinstance(value, Mapping):
            sub = {}
            for sub_key, sub_raw in value.items():
                sub_value = as_python_scalar(sub_raw)
                if not is_number(sub_value):
                    raise TypeError(f"{tracker}: cannot log {key!r}: the dict entry {sub_key!r} is a "
                                    f"{type(sub_value).__name__}; dict values must be numbers.")
                sub[str(sub_key)] = sub_value
            out[key] = sub
        elif is_number(value) or (allow_text and isinstance(value, str)):
            out[key] = value
        else:
            raise TypeError(f"{tracker}: cannot log {key!r}: a {type(value).__name__} is neither a number "
                            f"(int, float, 0-d tensor), text nor a dict of numbers. Log e.g. "
                            f"`{{{key!r}: value.mean().item()}}` instead.")
    return out


def jsonable(value: Any) -> Any:
    """A JSON-friendly version of a configuration value (tensors -> numbers/lists, unknown objects -> str)."""
    value = as_python_scalar(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return tolist()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value)


def write_text_atomically(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename (never a half-written file)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def dump_json(values: Any) -> str:
    """JSON text of ``values`` with non-JSON objects converted by :func:`jsonable`."""
    return json.dumps(jsonable(values), indent=2, sort_keys=True, allow_nan=True)
