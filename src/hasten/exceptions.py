"""The exceptions hasten raises. User mistakes are ``ValueError`` subclasses so that code written
for Accelerate (which raises ``ValueError``) keeps catching them."""

from __future__ import annotations


class HastenError(Exception):
    """Base class of every error hasten raises on purpose."""


class ConfigurationError(HastenError, ValueError):
    """A bad or conflicting setting: the message names the value, its source and the fix."""


class MissingDependencyError(HastenError, ImportError):
    """An optional package is needed for the requested feature; the message gives the pip command."""

    def __init__(self, package: str, feature: str, extra: str | None = None) -> None:
        install = f"pip install 'hasten[{extra}]'" if extra else f"pip install {package}"
        super().__init__(f"{feature} needs the optional package `{package}`, which is not installed. "
                         f"HINT: {install}")
        self.package = package


class DistributedOperationError(HastenError, RuntimeError):
    """Ranks disagreed on a collective (different operation or shapes) or one never reached it."""


class LaunchError(HastenError, RuntimeError):
    """Processes could not be started, or a worker failed."""


#: Accelerate's name for the error its debug mode raises (``accelerate.utils.operations``); the same class.
DistributedOperationException = DistributedOperationError


class CheckpointError(HastenError, RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or does not match what is being restored."""
