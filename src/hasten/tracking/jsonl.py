"""``JSONLTracker`` (``log_with="jsonl"``): the dependency-free tracker, one JSON object per line.

This tracker is hasten's own (Accelerate has no ``"jsonl"`` logger type). Layout, under
``{logging_dir}/{project_name}/``:

- ``metrics.jsonl``: one line per ``log`` call, ``{"_step": 3, "_time": 1712.5, "loss": 0.25, ...}``
  (``_step`` is null when no step was given; ``_time`` is Unix time). Lines are appended, so a resumed
  run continues the same file. Read it with ``JSONLTracker.read(path)`` or ``pandas.read_json(path,
  lines=True)``.
- ``config.json``: the hyperparameters given to ``init_trackers(config=...)``, written atomically.
"""

from __future__ import annotations

import json
import os
import time
from typing import IO, Any

from hasten.tracking.base import (
    GeneralTracker,
    dump_json,
    on_main_process,
    scalar_items,
    write_text_atomically,
)

_RESERVED = ("_step", "_time")


def _ends_without_newline(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return False
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"
    except FileNotFoundError:
        return False


class JSONLTracker(GeneralTracker):
    """Append metrics as JSON lines to ``{logging_dir}/{run_name}/metrics.jsonl`` (no extra package needed).

    Args:
        run_name: the project name given to ``init_trackers``; names the sub-folder.
        logging_dir: the folder for the logs (``Accelerator(project_dir=...)``).

    Example:
        >>> accelerator = Accelerator(log_with="jsonl", project_dir="runs")
        >>> accelerator.init_trackers("demo", config={"lr": 1e-3})
        >>> accelerator.log({"loss": 0.5}, step=1)
        >>> accelerator.end_training()
        >>> JSONLTracker.read("runs/demo")[0]["loss"]
        0.5
    """

    name = "jsonl"
    requires_logging_directory = True
    metrics_file = "metrics.jsonl"
    config_file = "config.json"

    def __init__(self, run_name: str, logging_dir: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__()
        if kwargs:
            raise TypeError(f"JSONLTracker takes no options, got {sorted(kwargs)}; remove them from "
                            "init_kwargs['jsonl'].")
        self.run_name = run_name
        self.logging_dir = os.path.join(os.fspath(logging_dir), run_name)
        self._file: IO[str] | None = None

    @property
    def metrics_path(self) -> str:
        return os.path.join(self.logging_dir, self.metrics_file)

    @property
    def config_path(self) -> str:
        return os.path.join(self.logging_dir, self.config_file)

    @property
    def tracker(self) -> IO[str] | None:
        """The open ``metrics.jsonl`` file (None before ``start`` and after ``finish``)."""
        return self._file

    @on_main_process
    def start(self) -> None:
        os.makedirs(self.logging_dir, exist_ok=True)
        torn = _ends_without_newline(self.metrics_path)
        self._file = open(self.metrics_path, "a", encoding="utf-8")  # noqa: SIM115 - closed in finish()
        if torn:  # an earlier run died mid-line: keep its fragment on a line of its own
            self._file.write("\n")

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Write ``values`` to ``config.json`` (non-JSON values such as paths or tensors are converted)."""
        write_text_atomically(self.config_path, dump_json(values) + "\n")

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Append one line holding ``values`` (numbers, text, dicts of numbers) and ``step``."""
        if kwargs:
            raise TypeError(f"JSONLTracker.log takes no extra options, got {sorted(kwargs)}")
        if self._file is None:
            raise RuntimeError("JSONLTracker.log was called before start() (or after finish()): call "
                               "accelerator.init_trackers(...) first.")
        record = scalar_items(values, "jsonl tracker")
        clash = [key for key in _RESERVED if key in record]
        if clash:
            raise ValueError(f"jsonl tracker: the names {clash} are reserved for the step and time columns; "
                             "rename those values.")
        line = json.dumps({"_step": step, "_time": time.time(), **record}, allow_nan=True)
        # One write per record: a crash can only tear the last line, which read() skips.
        self._file.write(line + "\n")
        self._file.flush()

    @on_main_process
    def finish(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> list[dict[str, Any]]:
        """The records of a ``metrics.jsonl`` file (or of the run folder holding one), in order.

        Lines cut short by a crash (not valid JSON) are skipped.

        Example:
            >>> [r["loss"] for r in JSONLTracker.read("runs/demo")]
        """
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, cls.metrics_file)
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
        records = []
        for line in lines:
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line torn by a crash (each record is written with a single write call)
        return records

    @classmethod
    def read_config(cls, path: str | os.PathLike[str]) -> dict[str, Any]:
        """The hyperparameters stored in a run folder's ``config.json``."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, cls.config_file)
        with open(path, encoding="utf-8") as f:
            return json.load(f)
