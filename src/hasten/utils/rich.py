"""Accelerate's ``accelerate.utils.rich``: importing it installs rich's traceback printer (needs ``rich``)."""

from hasten.base.imports import is_rich_available
from hasten.exceptions import MissingDependencyError

if not is_rich_available():
    raise MissingDependencyError("rich", "rich tracebacks (`import hasten.utils.rich`)")

from rich.traceback import install  # noqa: E402

install(show_locals=False)
