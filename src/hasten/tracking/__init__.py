"""Experiment trackers: ``GeneralTracker`` and the built-in JSON-lines, TensorBoard, W&B and MLflow trackers.

Select them with ``Accelerator(log_with=...)``: ``"jsonl"`` (no extra package), ``"tensorboard"``
(``pip install 'hasten[tensorboard]'``), ``"wandb"`` (``hasten[wandb]``), ``"mlflow"`` (``hasten[mlflow]``),
``"all"`` (every installed one), or instances of your own ``GeneralTracker`` subclasses. The tracker
libraries are imported only when a tracker starts.

Example:
    >>> accelerator = Accelerator(log_with=["jsonl", "tensorboard"], project_dir="runs")
    >>> accelerator.init_trackers("demo", config={"lr": 1e-3})
    >>> accelerator.log({"loss": 0.25}, step=10)
    >>> accelerator.end_training()
"""

from hasten._lazy import accelerate_path_getattr
from hasten.tracking._clearml_comet import ClearMLTracker, CometMLTracker
from hasten.tracking._local_trackers import AimTracker, DVCLiveTracker, SwanLabTracker, TrackioTracker
from hasten.tracking._mlflow import MLflowTracker
from hasten.tracking._tensorboard import TensorBoardTracker
from hasten.tracking._wandb import WandBTracker
from hasten.tracking.base import GeneralTracker, on_main_process
from hasten.tracking.jsonl import JSONLTracker
from hasten.tracking.registry import (
    LOGGER_TYPE_TO_CLASS,
    filter_trackers,
    get_available_trackers,
    is_tracker_available,
    register_tracker_class,
)

__all__ = [
    "AimTracker",
    "ClearMLTracker",
    "CometMLTracker",
    "DVCLiveTracker",
    "SwanLabTracker",
    "TrackioTracker",
    "GeneralTracker",
    "JSONLTracker",
    "LOGGER_TYPE_TO_CLASS",
    "MLflowTracker",
    "TensorBoardTracker",
    "WandBTracker",
    "filter_trackers",
    "get_available_trackers",
    "is_tracker_available",
    "on_main_process",
    "register_tracker_class",
]

# Names Accelerate's module at this path shows but defines elsewhere (hasten/_accelerate_shown.py).
__getattr__ = accelerate_path_getattr(__name__, globals())
