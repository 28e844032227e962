"""``ClearMLTracker`` (``log_with="clearml"``) and ``CometMLTracker`` (``log_with="comet_ml"``).

Both work offline with their own switches: ClearML's ``Task.set_offline(True)`` (or
``CLEARML_OFFLINE_MODE=1``) stores the session under ``~/.clearml/cache/offline``; Comet's
``online=False`` (or ``COMET_MODE=offline``) writes a zip under the experiment config's
``offline_directory``. Both upload later with their own commands.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hasten.exceptions import MissingDependencyError
from hasten.logging import get_logger
from hasten.tracking.base import GeneralTracker, as_python_scalar, on_main_process, scalar_items

_logger = get_logger(__name__)


def _require(module: str, package: str, name: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(package, f"log_with={name!r}", extra=name) from exc


class ClearMLTracker(GeneralTracker):
    """Log to a ClearML task (a task already running in the process, e.g. started by a ClearML agent, is reused).

    Args:
        run_name: the project name given to ``init_trackers``; the default ``project_name`` and ``task_name``.
        **kwargs: passed to ``clearml.Task.init`` (``project_name``, ``task_name``, ``tags``...).

    Example:
        >>> accelerator = Accelerator(log_with="clearml")
        >>> accelerator.init_trackers("demo", init_kwargs={"clearml": {"task_name": "baseline"}})
    """

    name = "clearml"
    requires_logging_directory = False

    def __init__(self, run_name: str | None = None, **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.init_kwargs = kwargs
        self.task: Any = None
        self._initialized_externally = False

    @on_main_process
    def start(self) -> None:
        clearml = _require("clearml", "clearml", self.name)
        current = clearml.Task.current_task()
        if current is not None:
            self._initialized_externally = True
            self.task = current
            return
        kwargs = dict(self.init_kwargs)
        kwargs.setdefault("project_name", self.run_name)
        kwargs.setdefault("task_name", self.run_name)
        self.task = clearml.Task.init(**kwargs)

    @property
    def tracker(self) -> Any:
        """The ``clearml.Task``."""
        return self.task

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Attach ``values`` to the task as its configuration."""
        self.task.connect_configuration(dict(values))

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Numbers become scalars (title = series = the key; a dict value gives one series per entry);
        without ``step`` they are single summary values. Text is reported to the task's log."""
        logger = self.task.get_logger()
        for key, value in scalar_items(values, "clearml tracker").items():
            series = value.items() if isinstance(value, Mapping) else [(key, value)]
            for series_name, number in series:
                if isinstance(number, str):
                    logger.report_text(f"{key}: {number}", **kwargs)
                elif step is None:
                    logger.report_single_value(name=f"{key}/{series_name}" if series_name != key else key,
                                               value=float(number), **kwargs)
                else:
                    logger.report_scalar(title=key, series=str(series_name), value=float(number), iteration=step,
                                         **kwargs)

    @on_main_process
    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Report images (arrays or PIL images) under their keys."""
        logger = self.task.get_logger()
        for key, image in values.items():
            logger.report_image(title=key, series=key, iteration=step or 0, image=image, **kwargs)

    @on_main_process
    def log_table(self, table_name: str, columns: list[str] | None = None, data: list[list[Any]] | None = None,
                  dataframe: Any = None, step: int | None = None, **kwargs: Any) -> None:
        """Report a table, from ``columns`` + ``data`` rows or a pandas ``dataframe``."""
        if dataframe is None:
            if data is None:
                raise ValueError("ClearMLTracker.log_table needs `data` (rows) or `dataframe`")
            table = [list(columns)] + [list(row) for row in data] if columns is not None else data
        else:
            table = dataframe
        self.task.get_logger().report_table(title=table_name, series=table_name, iteration=step or 0,
                                            table_plot=table, **kwargs)

    @on_main_process
    def finish(self) -> None:
        """Close the task (unless it was started outside, by ClearML itself)."""
        if self.task is not None and not self._initialized_externally:
            self.task.close()


class CometMLTracker(GeneralTracker):
    """Log to a Comet experiment in the project named after the run (``comet_ml.start``).

    Args:
        run_name: the project name given to ``init_trackers``.
        **kwargs: passed to ``comet_ml.start`` (``workspace``, ``online=False``, ``experiment_config``...).

    Example:
        >>> accelerator = Accelerator(log_with="comet_ml")
        >>> accelerator.init_trackers("demo", init_kwargs={"comet_ml": {"online": False}})
    """

    name = "comet_ml"
    requires_logging_directory = False

    def __init__(self, run_name: str | None = None, **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.init_kwargs = kwargs
        self.writer: Any = None

    @on_main_process
    def start(self) -> None:
        comet_ml = _require("comet_ml", "comet-ml", self.name)
        self.writer = comet_ml.start(project_name=self.run_name, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        """The Comet experiment."""
        return self.writer

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Log ``values`` as the experiment's parameters."""
        self.writer.log_parameters({k: as_python_scalar(v) for k, v in values.items()})

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Numbers become metrics, text becomes "other" values, dicts of numbers several metrics."""
        if step is not None:
            self.writer.set_step(step)
        for key, value in scalar_items(values, "comet_ml tracker").items():
            if isinstance(value, str):
                self.writer.log_other(key, value, **kwargs)
            elif isinstance(value, Mapping):
                self.writer.log_metrics({f"{key}/{k}": v for k, v in value.items()}, step=step, **kwargs)
            else:
                self.writer.log_metric(key, value, step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        """End the experiment (offline: write its archive)."""
        if self.writer is not None:
            self.writer.end()
