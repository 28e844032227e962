"""Experiment tracking on the Accelerator: ``init_trackers``, ``log``, ``get_tracker`` and finishing them.

The Accelerator sets ``state``, ``log_with`` (from ``hasten.tracking.filter_trackers``), ``logging_dir``
and ``trackers`` (an empty list) before any of these methods run.
"""

from __future__ import annotations

from typing import Any

from hasten.accelerator._base import AcceleratorBase
from hasten.tracking import LOGGER_TYPE_TO_CLASS, GeneralTracker


def _entry_name(entry: Any) -> str:
    return entry.name if isinstance(entry, GeneralTracker) else str(getattr(entry, "value", entry))


def _entry_class(entry: Any) -> type[GeneralTracker]:
    return type(entry) if isinstance(entry, GeneralTracker) else LOGGER_TYPE_TO_CLASS[_entry_name(entry)]


def _main_process_only(entry: Any) -> bool:
    # an instance may set the flag itself; a name uses its class's flag
    source = entry if isinstance(entry, GeneralTracker) else _entry_class(entry)
    return bool(getattr(source, "main_process_only", True))


class TrackingMixin(AcceleratorBase):
    """Trackers live on the main process (or on every process for ``main_process_only=False`` trackers)."""

    trackers: list[GeneralTracker]

    def _hosts_tracker(self, entry: Any) -> bool:
        return self.state.is_main_process or not _main_process_only(entry)

    def init_trackers(self, project_name: str, config: dict[str, Any] | None = None,
                      init_kwargs: dict[str, dict[str, Any]] | None = None) -> None:
        """Start the trackers of ``log_with`` and record ``config`` as the run's hyperparameters.

        Call it on every process: trackers are created on the main process only (except custom ones
        with ``main_process_only = False``); elsewhere it does nothing. Calling it again before
        ``end_training()`` is an error (Accelerate would start a second set of runs and log everything twice).

        Args:
            project_name: names the run/experiment/sub-folder of every tracker.
            config: hyperparameters (``store_init_configuration``).
            init_kwargs: per-tracker constructor options keyed by tracker name, e.g.
                ``{"wandb": {"tags": ["a"]}, "tensorboard": {"flush_secs": 30}}``.

        Example:
            >>> accelerator = Accelerator(log_with="jsonl", project_dir="runs")
            >>> accelerator.init_trackers("demo", config={"lr": 1e-3, "epochs": 3})
        """
        if self.trackers:
            raise RuntimeError(f"init_trackers({project_name!r}) was called while trackers "
                               f"{[t.name for t in self.trackers]} are already running; call it once per run "
                               "(accelerator.end_training() finishes them).")
        init_kwargs = dict(init_kwargs or {})
        self._check_init_kwargs(init_kwargs)
        trackers: list[GeneralTracker] = []
        for entry in self.log_with:
            if not self._hosts_tracker(entry):
                continue
            if isinstance(entry, GeneralTracker):
                trackers.append(entry)  # a user instance, already built
                continue
            cls: Any = _entry_class(entry)  # a concrete tracker class: its __init__ takes the project name
            kwargs = init_kwargs.get(_entry_name(entry), {})
            if cls.requires_logging_directory:
                trackers.append(cls(project_name, self.logging_dir, **kwargs))
            else:
                trackers.append(cls(project_name, **kwargs))
        started: list[GeneralTracker] = []
        try:
            for tracker in trackers:
                tracker.start()
                started.append(tracker)
            if config is not None:
                for tracker in trackers:
                    tracker.store_init_configuration(config)
        except BaseException:
            self._finish(started)  # don't leave half-started runs (open files, wandb processes) behind
            raise
        self.trackers = trackers

    def _check_init_kwargs(self, init_kwargs: dict[str, Any]) -> None:
        names = {_entry_name(entry) for entry in self.log_with}
        for key, value in init_kwargs.items():
            if not isinstance(value, dict):
                raise TypeError(f"init_kwargs[{key!r}] must be a dict of options for that tracker, got "
                                f"{type(value).__name__}; e.g. init_kwargs={{'wandb': {{'tags': ['a']}}}}")
            if key not in names and self.state.is_main_process:
                from hasten.logging import get_logger

                get_logger(__name__).warning(f"init_kwargs[{key!r}] is ignored: {key!r} is not among the "
                                             f"trackers in use ({sorted(names)}).")

    def log(self, values: dict[str, Any], step: int | None = None,
            log_kwargs: dict[str, dict[str, Any]] | None = None) -> None:
        """Log ``values`` (name -> number, text or dict of numbers) at ``step`` to every started tracker.

        Runs on the processes holding trackers (the main process); elsewhere it returns at once.

        Args:
            values: the metrics, e.g. ``{"loss": loss.item(), "lr": scheduler.get_last_lr()[0]}``.
            step: the step to record them at.
            log_kwargs: per-tracker options for their ``log``, keyed by tracker name.

        Example:
            >>> accelerator.log({"train_loss": 0.25, "epoch": 1}, step=100)
        """
        log_kwargs = log_kwargs or {}
        for tracker in self.trackers:
            tracker.log(values, step=step, **log_kwargs.get(tracker.name, {}))

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The started tracker called ``name`` (or, with ``unwrap=True``, its run/writer object).

        On a process that holds no trackers (every process but the main one) this returns
        ``GeneralTracker(_blank=True)``, whose methods do nothing, so the same code runs everywhere.

        Raises:
            ValueError: no tracker of that name was started (the message lists those that were).

        Example:
            >>> writer = accelerator.get_tracker("tensorboard", unwrap=True)
        """
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        hosted_elsewhere = any(_entry_name(e) == name and not self._hosts_tracker(e)
                               for e in self.log_with)
        if not self.trackers or hosted_elsewhere:
            return GeneralTracker(_blank=True)
        raise ValueError(f"{name!r} is not a tracker started by this Accelerator; started: "
                         f"{[t.name for t in self.trackers]}")

    def _finish_trackers(self) -> None:
        """Finish every started tracker (flush and close); called by ``end_training``."""
        trackers, self.trackers = self.trackers, []
        error = self._finish(trackers)
        if error is not None:
            raise error

    @staticmethod
    def _finish(trackers: list[GeneralTracker]) -> BaseException | None:
        # Finish them all even if one fails; the caller reports the first failure.
        error: BaseException | None = None
        for tracker in trackers:
            try:
                tracker.finish()
            except Exception as exc:  # noqa: BLE001 - returned to the caller
                error = error or exc
        return error
