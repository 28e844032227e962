"""``MLflowTracker`` (``log_with="mlflow"``): an MLflow run in the experiment named after the project."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from hasten.exceptions import MissingDependencyError
from hasten.logging import get_logger
from hasten.tracking.base import GeneralTracker, on_main_process, scalar_items


def _import_mlflow() -> Any:
    try:
        import mlflow
    except ImportError as exc:
        raise MissingDependencyError("mlflow", "log_with='mlflow'", extra="mlflow") from exc
    return mlflow


_logger = get_logger(__name__)


def _warn_once(message: str) -> None:
    _logger.warning_once(message)


class MLflowTracker(GeneralTracker):
    """Log to an MLflow run (params = the init configuration, metrics = the logged numbers).

    Where the run is stored is MLflow's choice: ``MLFLOW_TRACKING_URI`` or ``mlflow.set_tracking_uri``
    (hasten adds the ``tracking_uri`` argument for the same purpose). ``MLFLOW_EXPERIMENT_NAME`` and
    ``MLFLOW_RUN_ID`` override ``experiment_name`` and ``run_id``, as in Accelerate.

    Args:
        experiment_name: the experiment (the project name given to ``init_trackers``).
        logging_dir: artifact location of a newly created experiment.
        run_id: resume this run instead of creating one.
        tags: run tags, as a dict or its JSON text.
        nested_run: create the run nested in the active one.
        run_name: name of a new run.
        description: the run's description.
        tracking_uri: hasten extension: the tracking server or store, e.g. ``"file:/tmp/mlruns"``.

    Example:
        >>> accelerator = Accelerator(log_with="mlflow")
        >>> accelerator.init_trackers("demo", config={"lr": 0.1},
        ...                           init_kwargs={"mlflow": {"tracking_uri": "http://localhost:5000"}})
    """

    name = "mlflow"
    requires_logging_directory = False

    def __init__(self, experiment_name: str | None = None, logging_dir: str | os.PathLike[str] | None = None,
                 run_id: str | None = None, tags: dict[str, Any] | str | None = None, nested_run: bool = False,
                 run_name: str | None = None, description: str | None = None,
                 tracking_uri: str | None = None) -> None:
        super().__init__()
        if isinstance(tags, str):
            try:
                tags = json.loads(tags)
            except json.JSONDecodeError as exc:
                raise ValueError(f"MLflowTracker(tags={tags!r}): a string must hold a JSON object ({exc})") from exc
        self.experiment_name = experiment_name
        self.logging_dir = os.fspath(logging_dir) if logging_dir is not None else None
        self.run_id = run_id
        self.tags = tags
        self.nested_run = nested_run
        self.run_name = run_name
        self.description = description
        self.tracking_uri = tracking_uri
        self.active_run: Any = None

    @on_main_process
    def start(self) -> None:
        mlflow = _import_mlflow()
        from mlflow import environment_variables as mlflow_env

        if self.tracking_uri is not None:
            mlflow.set_tracking_uri(self.tracking_uri)
        experiment_name = mlflow_env.MLFLOW_EXPERIMENT_NAME.get() or self.experiment_name
        run_id = mlflow_env.MLFLOW_RUN_ID.get() or self.run_id
        experiment = mlflow.get_experiment_by_name(experiment_name) if experiment_name else None
        if experiment is not None:
            experiment_id = experiment.experiment_id
        elif experiment_name:
            experiment_id = mlflow.create_experiment(experiment_name, artifact_location=self.logging_dir,
                                                     tags=self.tags)
        else:
            experiment_id = None
        self.active_run = mlflow.start_run(run_id=run_id, experiment_id=experiment_id, run_name=self.run_name,
                                           nested=bool(self.nested_run), tags=self.tags,
                                           description=self.description)

    @property
    def tracker(self) -> Any:
        """The ``mlflow.ActiveRun``."""
        return self.active_run

    @property
    def _run_id(self) -> str:
        return self.active_run.info.run_id

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Log ``values`` as run parameters (as text; values too long for MLflow are dropped with a warning)."""
        mlflow = _import_mlflow()
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        params = {}
        for key, value in values.items():
            if len(str(value)) > MAX_PARAM_VAL_LENGTH:
                _warn_once(f"mlflow tracker: the config value for {key!r} is longer than MLflow's limit of "
                           f"{MAX_PARAM_VAL_LENGTH} characters and was not stored.")
                continue
            params[str(key)] = value
        items = list(params.items())
        for start in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            mlflow.log_params(dict(items[start:start + MAX_PARAMS_TAGS_PER_BATCH]), run_id=self._run_id)

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log numbers as metrics; ``{"loss": {"train": a, "val": b}}`` becomes ``loss/train`` and ``loss/val``.

        Text cannot be an MLflow metric: it is dropped with a one-time warning naming the key.

        Raises:
            TypeError: a value is neither a number, text nor a dict of numbers (the message names the key).
        """
        mlflow = _import_mlflow()
        metrics: dict[str, float] = {}
        for key, value in scalar_items(values, "mlflow tracker").items():
            if isinstance(value, Mapping):
                metrics.update({f"{key}/{sub}": float(v) for sub, v in value.items()})
            elif isinstance(value, str):
                _warn_once(f"mlflow tracker: {key!r} holds text; MLflow metrics are numbers, so it is not "
                           "logged to MLflow.")
            else:
                metrics[key] = float(value)
        if metrics:
            mlflow.log_metrics(metrics, step=step, run_id=self._run_id, **kwargs)

    @on_main_process
    def log_figure(self, figure: Any, artifact_file: str, **save_kwargs: Any) -> None:
        """Save a matplotlib/plotly figure as an artifact of the run."""
        _import_mlflow().log_figure(figure=figure, artifact_file=artifact_file, **save_kwargs)

    @on_main_process
    def log_artifacts(self, local_dir: str, artifact_path: str | None = None) -> None:
        """Upload every file under ``local_dir`` as artifacts of the run."""
        _import_mlflow().log_artifacts(local_dir=local_dir, artifact_path=artifact_path)

    @on_main_process
    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        """Upload one file as an artifact of the run."""
        _import_mlflow().log_artifact(local_path=local_path, artifact_path=artifact_path)

    @on_main_process
    def finish(self) -> None:
        if self.active_run is not None:
            _import_mlflow().end_run()
