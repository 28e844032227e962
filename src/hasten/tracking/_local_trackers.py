"""``AimTracker``, ``DVCLiveTracker``, ``SwanLabTracker`` and ``TrackioTracker``: trackers whose runs live
in local files by default (Aim's repository, DVCLive's ``dvclive/`` folder, SwanLab's ``mode="local"`` /
``"offline"``, Trackio's local database), each through its own package, imported when the tracker starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from hasten.tracking._clearml_comet import _require
from hasten.tracking.base import GeneralTracker, as_python_scalar, on_main_process, scalar_items


def _numbers(values: Mapping[str, Any], tracker: str) -> dict[str, Any]:
    """Flatten ``{"loss": {"train": a}}`` to ``{"loss/train": a}``; text is kept as text."""
    out: dict[str, Any] = {}
    for key, value in scalar_items(values, tracker).items():
        if isinstance(value, Mapping):
            out.update({f"{key}/{sub}": number for sub, number in value.items()})
        else:
            out[key] = value
    return out


class AimTracker(GeneralTracker):
    """Log to an Aim run in the repository at ``logging_dir``.

    Args:
        run_name: the experiment name (the project name given to ``init_trackers``).
        logging_dir: the Aim repository folder (created when missing).
        **kwargs: passed to ``aim.Run``.
    """

    name = "aim"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike[str] | None = ".", **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.logging_dir = os.fspath(logging_dir or ".")
        self.init_kwargs = kwargs
        self.writer: Any = None

    @on_main_process
    def start(self) -> None:
        aim = _require("aim", "aim", self.name)
        self.writer = aim.Run(repo=self.logging_dir, experiment=self.run_name, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        """The ``aim.Run``."""
        return self.writer

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Store ``values`` as the run's ``hparams``."""
        self.writer["hparams"] = {k: as_python_scalar(v) for k, v in values.items()}

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Track each value (numbers as metrics, text as ``aim.Text``) at ``step``."""
        aim = _require("aim", "aim", self.name)
        for key, value in _numbers(values, "aim tracker").items():
            self.writer.track(aim.Text(value) if isinstance(value, str) else value, name=key, step=step, **kwargs)

    @on_main_process
    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Track images: ``{"name": image}`` or ``{"name": (image, caption)}``."""
        aim = _require("aim", "aim", self.name)
        for key, value in values.items():
            image, caption = value if isinstance(value, tuple) else (value, "")
            self.writer.track(aim.Image(image, caption), name=key, step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        if self.writer is not None:
            self.writer.close()


class DVCLiveTracker(GeneralTracker):
    """Log to DVCLive (metrics files under ``dvclive/`` by default, and plots).

    Args:
        run_name: unused by DVCLive (kept for Accelerate's signature).
        live: an existing ``dvclive.Live`` to log to, else one is created with ``kwargs``.
        **kwargs: passed to ``dvclive.Live`` (``dir``, ``save_dvc_exp``...).
    """

    name = "dvclive"
    requires_logging_directory = False

    def __init__(self, run_name: str | None = None, live: Any = None, **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.live = live
        self.init_kwargs = kwargs

    @on_main_process
    def start(self) -> None:
        dvclive = _require("dvclive", "dvclive", self.name)
        if self.live is None:
            self.live = dvclive.Live(**self.init_kwargs)

    @property
    def tracker(self) -> Any:
        """The ``dvclive.Live``."""
        return self.live

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Log ``values`` as parameters (``params.yaml``)."""
        self.live.log_params({k: as_python_scalar(v) for k, v in values.items()})

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log the numbers at ``step`` (DVCLive's own step counter otherwise), then advance it."""
        if step is not None:
            self.live.step = step
        for key, value in _numbers(values, "dvclive tracker").items():
            if not isinstance(value, str):
                self.live.log_metric(key, value, **kwargs)
        self.live.next_step()

    @on_main_process
    def finish(self) -> None:
        if self.live is not None:
            self.live.end()


class _ProjectRunTracker(GeneralTracker):
    """A run started by ``<package>.init(project=run_name, **kwargs)`` with a module-level ``config`` and
    ``run.log(values, step=...)`` / ``run.finish()``: the API SwanLab and Trackio share (after W&B's).

    Subclasses name the package and say whether text values are logged (``logs_text``).
    """

    package: str
    logs_text: bool = True
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.init_kwargs = kwargs
        self.run: Any = None

    def _module(self) -> Any:
        return _require(self.package, self.package, self.name)

    @on_main_process
    def start(self) -> None:
        self.run = self._module().init(project=self.run_name, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        """The run object ``init`` returned."""
        return self.run

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Add ``values`` to the run's config."""
        self._module().config.update({k: as_python_scalar(v) for k, v in values.items()})

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log numbers (and text, where the tool keeps text) at ``step``."""
        items = _numbers(values, f"{self.name} tracker")
        if not self.logs_text:
            items = {k: v for k, v in items.items() if not isinstance(v, str)}
        self.run.log(items, step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()


class SwanLabTracker(_ProjectRunTracker):
    """Log to a SwanLab run of the project named after the run (``mode="local"`` or ``"offline"`` keeps it on disk).

    Args:
        run_name: the project name given to ``init_trackers``.
        **kwargs: passed to ``swanlab.init`` (``mode``, ``logdir``, ``experiment_name``...).
    """

    name = "swanlab"
    package = "swanlab"

    @on_main_process
    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log images: ``{"name": image}`` or a list of images per name."""
        swanlab = self._module()
        images = {k: [swanlab.Image(i) for i in v] if isinstance(v, list) else swanlab.Image(v)
                  for k, v in values.items()}
        self.run.log(images, step=step, **kwargs)


class TrackioTracker(_ProjectRunTracker):
    """Log to a Trackio run of the project named after the run (a local database unless a Space is given).

    Text values are skipped: Trackio plots numbers.

    Args:
        run_name: the project name given to ``init_trackers``.
        **kwargs: passed to ``trackio.init`` (``name``, ``space_id``...).
    """

    name = "trackio"
    package = "trackio"
    logs_text = False
