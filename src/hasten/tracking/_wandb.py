"""``WandBTracker`` (``log_with="wandb"``): a Weights & Biases run (online, or offline with ``WANDB_MODE=offline``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hasten.exceptions import MissingDependencyError
from hasten.tracking.base import GeneralTracker, as_python_scalar, on_main_process


def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError as exc:
        raise MissingDependencyError("wandb", "log_with='wandb'", extra="wandb") from exc
    return wandb


class WandBTracker(GeneralTracker):
    """Log to a Weights & Biases run named after the project.

    wandb's own settings apply: ``WANDB_MODE=offline`` writes the run under ``WANDB_DIR`` (or ``dir=``)
    without touching the network; ``wandb sync`` uploads it later.

    Args:
        run_name: the project name given to ``init_trackers`` (becomes ``wandb.init(project=...)``).
        **kwargs: passed to ``wandb.init`` (``entity``, ``name``, ``tags``, ``dir``, ``mode``...).

    Example:
        >>> accelerator = Accelerator(log_with="wandb")
        >>> accelerator.init_trackers("demo", init_kwargs={"wandb": {"mode": "offline", "tags": ["a"]}})
    """

    name = "wandb"
    requires_logging_directory = False
    # Accelerate marks wandb ``main_process_only = False`` but only ever starts it on the main process; in
    # hasten the flag decides where a tracker lives, so one run per job means True here.
    main_process_only = True

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.init_kwargs = kwargs
        self.run: Any = None

    @on_main_process
    def start(self) -> None:
        wandb = _import_wandb()
        self.run = wandb.init(project=self.run_name, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        """The ``wandb`` run."""
        return self.run

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Add ``values`` to the run's config (also in offline mode)."""
        self.run.config.update(dict(values), allow_val_change=True)

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """``run.log(values, step=step)``; one-element tensors become numbers, wandb objects pass through."""
        if not isinstance(values, Mapping):
            raise TypeError(f"wandb tracker: `values` must be a dict of name -> value, got {type(values).__name__}")
        self.run.log({key: as_python_scalar(value) for key, value in values.items()}, step=step, **kwargs)

    @on_main_process
    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log lists of images (arrays or PIL images) as ``wandb.Image`` objects."""
        wandb = _import_wandb()
        self.run.log({key: [wandb.Image(image) for image in images] for key, images in values.items()},
                     step=step, **kwargs)

    @on_main_process
    def log_table(self, table_name: str, columns: list[str] | None = None, data: list[list[Any]] | None = None,
                  dataframe: Any = None, step: int | None = None, **kwargs: Any) -> None:
        """Log a ``wandb.Table`` built from ``columns`` + ``data`` or from ``dataframe``."""
        wandb = _import_wandb()
        table = wandb.Table(columns=columns, data=data, dataframe=dataframe)
        self.run.log({table_name: table}, step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
