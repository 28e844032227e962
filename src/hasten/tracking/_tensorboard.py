"""``TensorBoardTracker`` (``log_with="tensorboard"``): event files under ``{logging_dir}/{project_name}``."""

from __future__ import annotations

import os
import time
from typing import Any

from hasten.exceptions import MissingDependencyError
from hasten.tracking.base import (
    GeneralTracker,
    as_python_scalar,
    jsonable,
    on_main_process,
    scalar_items,
    write_text_atomically,
)


def _summary_writer_class() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter
    except ImportError:
        pass
    try:
        from tensorboardX import SummaryWriter as StandaloneWriter  # the stand-alone writer works too

        return StandaloneWriter
    except ImportError as exc:
        raise MissingDependencyError("tensorboard", "log_with='tensorboard'", extra="tensorboard") from exc


def _hparam_value(value: Any) -> Any:
    # add_hparams takes only bool/int/float/str/tensor; anything else (None, lists, paths) is shown as text
    # instead of failing deep inside torch. The exact values also go to hparams.yml.
    value = as_python_scalar(value)
    if isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


class TensorBoardTracker(GeneralTracker):
    """Write TensorBoard event files to ``{logging_dir}/{run_name}``.

    Args:
        run_name: the project name given to ``init_trackers``.
        logging_dir: the folder for the logs.
        **kwargs: passed to ``torch.utils.tensorboard.SummaryWriter`` (e.g. ``flush_secs``).

    Example:
        >>> accelerator = Accelerator(log_with="tensorboard", project_dir="runs")
        >>> accelerator.init_trackers("demo", init_kwargs={"tensorboard": {"flush_secs": 30}})
    """

    name = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.logging_dir_param = logging_dir
        self.logging_dir = os.path.join(os.fspath(logging_dir), run_name)
        self.init_kwargs = kwargs
        self.writer: Any = None

    @on_main_process
    def start(self) -> None:
        writer_class = _summary_writer_class()
        self.writer = writer_class(self.logging_dir, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        """The ``SummaryWriter``."""
        return self.writer

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Record ``values`` with ``add_hparams`` and as ``hparams.yml``, both in ``{logging_dir}/{timestamp}``.

        Values TensorBoard cannot show (None, lists, paths...) appear there as text; ``hparams.yml``
        keeps them as they are.
        """
        import yaml

        run = str(time.time())
        hparams = {str(k): _hparam_value(v) for k, v in values.items()}
        self.writer.add_hparams(hparams, metric_dict={}, run_name=run)
        self.writer.flush()
        write_text_atomically(os.path.join(self.logging_dir, run, "hparams.yml"),
                              yaml.safe_dump(jsonable(values), sort_keys=True))

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Numbers -> ``add_scalar``, text -> ``add_text``, dicts of numbers -> ``add_scalars``.

        Raises:
            TypeError: a value is none of these (the message names its key).
        """
        for key, value in scalar_items(values, "tensorboard tracker").items():
            if isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, dict):
                self.writer.add_scalars(key, value, global_step=step, **kwargs)
            else:
                self.writer.add_scalar(key, value, global_step=step, **kwargs)
        self.writer.flush()

    @on_main_process
    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log batches of images (``add_images``: arrays or tensors shaped N x C x H x W by default)."""
        for key, images in values.items():
            self.writer.add_images(key, images, global_step=step, **kwargs)
        self.writer.flush()

    @on_main_process
    def finish(self) -> None:
        if self.writer is not None:
            self.writer.close()
