"""Trackers without optional packages: GeneralTracker, the JSON-lines tracker, filter_trackers and the
Accelerator's tracking methods (TrackingMixin) on 1 and 2 ranks."""

import json
import os
from fractions import Fraction

import numpy as np
import pytest
import torch

from hasten.accelerator._tracking import TrackingMixin
from hasten.exceptions import ConfigurationError, MissingDependencyError
from hasten.state import AcceleratorState
from hasten.tracking import (
    LOGGER_TYPE_TO_CLASS,
    GeneralTracker,
    JSONLTracker,
    filter_trackers,
    get_available_trackers,
    register_tracker_class,
    registry,
)
from hasten.utils.dataclasses import LoggerType


class StandIn(TrackingMixin):
    """The attributes Accelerator.__init__ gives the mixin, without the rest of the Accelerator."""

    def __init__(self, log_with, logging_dir=None):
        self.state = AcceleratorState(_from_accelerator=True)
        self.logging_dir = None if logging_dir is None else str(logging_dir)
        self.log_with = filter_trackers(log_with, self.logging_dir)
        self.trackers = []


class RecordingTracker(GeneralTracker):
    """A custom tracker that records every call (in memory and, for multi-rank tests, in a file)."""

    name = "recording"
    requires_logging_directory = False

    def __init__(self, path=None, main_process_only=True):
        super().__init__()
        self.calls = []
        self.path = path
        self.main_process_only = main_process_only

    @property
    def tracker(self):
        return self.calls

    def _record(self, *call):
        self.calls.append(call)
        if self.path is not None:
            rank = int(torch.distributed.get_rank()) if torch.distributed.is_initialized() else 0
            with open(f"{self.path}.rank{rank}", "a") as f:
                f.write(json.dumps(call) + "\n")

    def start(self):
        self._record("start")

    def store_init_configuration(self, values):
        self._record("config", values)

    def log(self, values, step=None, **kwargs):
        self._record("log", values, step, kwargs)

    def finish(self):
        self._record("finish")


# ------------------------------------------------------------------------------------- GeneralTracker
def test_general_tracker_requires_name_directory_flag_and_tracker():
    class Incomplete(GeneralTracker):
        pass

    with pytest.raises(NotImplementedError, match="name.*requires_logging_directory.*tracker"):
        Incomplete()
    assert RecordingTracker().main_process_only is True


def test_blank_tracker_swallows_any_method_call():
    blank = GeneralTracker(_blank=True)
    assert blank.log({"a": 1}, step=1) is None
    assert blank.log_images({"img": []}, step=2) is None  # a method only some trackers have
    assert blank.tracker is None
    assert repr(blank) == "GeneralTracker(_blank=True)"
    with pytest.raises(AttributeError):
        RecordingTracker().log_images  # noqa: B018 - a real tracker keeps normal attribute errors


# ------------------------------------------------------------------------------------- JSONL tracker
def test_jsonl_tracker_writes_lines_and_config(tmp_path):
    tracker = JSONLTracker("proj", tmp_path)
    tracker.start()
    tracker.store_init_configuration({"lr": 0.1, "path": tmp_path, "dims": (2, 3), "none": None})
    tracker.log({"loss": torch.tensor(0.5), "acc": np.float32(0.25), "phase": "train", "pair": {"a": 1},
                 "n": np.int64(7), "frac": Fraction(1, 8)}, step=3)
    tracker.log({"loss": float("nan")})
    tracker.finish()
    records = JSONLTracker.read(tmp_path / "proj")
    assert [(r["_step"], r["loss"]) for r in records[:1]] == [(3, 0.5)]
    assert records[0]["acc"] == 0.25 and records[0]["phase"] == "train" and records[0]["pair"] == {"a": 1}
    assert records[0]["n"] == 7 and records[0]["frac"] == 0.125
    assert records[1]["_step"] is None and np.isnan(records[1]["loss"])
    assert JSONLTracker.read_config(tmp_path / "proj") == {"lr": 0.1, "path": str(tmp_path), "dims": [2, 3],
                                                           "none": None}
    assert sorted(os.listdir(tmp_path / "proj")) == ["config.json", "metrics.jsonl"]  # no temporary left


def test_jsonl_tracker_resumes_after_a_torn_line(tmp_path):
    folder = tmp_path / "proj"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text('{"_step": 1, "loss": 1.0}\n{"_step": 2, "lo')  # killed mid-write
    tracker = JSONLTracker("proj", tmp_path)
    tracker.start()
    tracker.log({"loss": 0.5}, step=2)
    tracker.finish()
    assert [(r["_step"], r["loss"]) for r in JSONLTracker.read(folder)] == [(1, 1.0), (2, 0.5)]


@pytest.mark.parametrize("values, match", [
    ({"weights": torch.ones(3)}, "'weights'.*Tensor"),
    ({"hist": [1, 2]}, "'hist'.*list"),
    ({"pair": {"a": "x"}}, "'pair'.*'a'"),
    ({1: 0.5}, "names must be strings"),
])
def test_jsonl_tracker_rejects_values_it_cannot_store_naming_the_key(tmp_path, values, match):
    tracker = JSONLTracker("proj", tmp_path)
    tracker.start()
    with pytest.raises(TypeError, match=match):
        tracker.log(values, step=0)
    with pytest.raises(ValueError, match="reserved"):
        tracker.log({"_step": 1})
    tracker.finish()


def test_jsonl_tracker_log_before_start_is_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match="init_trackers"):
        JSONLTracker("proj", tmp_path).log({"a": 1})
    with pytest.raises(TypeError, match="takes no options"):
        JSONLTracker("proj", tmp_path, flush_secs=3)


# ------------------------------------------------------------------------------------- filter_trackers
def test_filter_trackers_names_enums_instances_and_duplicates(tmp_path):
    custom = RecordingTracker()
    chosen = filter_trackers(["JSONL", LoggerType.JSONL, custom, custom], tmp_path)
    assert chosen == [LoggerType.JSONL, custom]
    assert filter_trackers(None) == [] and filter_trackers("jsonl", tmp_path) == [LoggerType.JSONL]


def test_filter_trackers_all_is_every_installed_tracker(tmp_path, monkeypatch):
    monkeypatch.setattr(registry, "is_tracker_available", lambda name: name in ("jsonl", "mlflow"))
    custom = RecordingTracker()
    assert filter_trackers(["all", custom], tmp_path) == [custom, LoggerType.JSONL, LoggerType.MLFLOW]
    with pytest.warns(UserWarning, match="jsonl"):  # needs a directory, none given: left out, said so
        assert filter_trackers(LoggerType.ALL) == [LoggerType.MLFLOW]


def test_filter_trackers_bad_input_messages(tmp_path, monkeypatch):
    with pytest.raises(ConfigurationError, match="'tensorbord' is not a known tracker.*'jsonl'.*'tensorboard'"):
        filter_trackers("tensorbord", tmp_path)
    with monkeypatch.context() as patch:  # every Accelerate tracker is built in; a missing package is named
        patch.setattr(registry, "is_tracker_available", lambda name: name != "aim")
        with pytest.raises(MissingDependencyError, match=r"log_with='aim'.*pip install 'hasten\[aim\]'"):
            filter_trackers("aim", tmp_path)
    with pytest.raises(ConfigurationError, match="project_dir"):
        filter_trackers("jsonl", None)
    with pytest.raises(TypeError, match="pass an instance"):
        filter_trackers([RecordingTracker], tmp_path)
    with pytest.raises(TypeError, match="tracker names"):
        filter_trackers([3], tmp_path)
    monkeypatch.setattr(registry, "is_tracker_available", lambda name: name == "jsonl")
    with pytest.raises(MissingDependencyError, match=r"pip install 'hasten\[wandb\]'"):
        filter_trackers(["jsonl", "wandb"], tmp_path)


def test_available_trackers_always_include_jsonl():
    assert LoggerType.JSONL in get_available_trackers()


def test_register_tracker_class_makes_a_name_selectable(tmp_path):
    @register_tracker_class
    class CSVTracker(RecordingTracker):
        name = "csv-test"
        requires_logging_directory = True

        def __init__(self, run_name, logging_dir, **kwargs):
            super().__init__()
            self.args = (run_name, logging_dir, kwargs)

    try:
        acc = StandIn("csv-test", tmp_path)
        acc.init_trackers("proj", init_kwargs={"csv-test": {"sep": ";"}})
        assert acc.get_tracker("csv-test").args == ("proj", str(tmp_path), {"sep": ";"})
        other = type("Other", (CSVTracker,), {})
        with pytest.warns(UserWarning, match="already registered and will be overwritten"):  # as Accelerate
            register_tracker_class(other)
        assert LOGGER_TYPE_TO_CLASS["csv-test"] is other
    finally:
        LOGGER_TYPE_TO_CLASS.pop("csv-test")


# ------------------------------------------------------------------------------------- Accelerator methods
def test_init_log_get_finish_with_a_custom_tracker(tmp_path):
    custom = RecordingTracker()
    acc = StandIn([custom, "jsonl"], tmp_path)
    acc.init_trackers("proj", config={"lr": 0.1}, init_kwargs={"recording": {}})
    acc.log({"loss": 1.5}, step=7, log_kwargs={"recording": {"commit": True}})
    assert acc.get_tracker("recording") is custom and acc.get_tracker("recording", unwrap=True) is custom.calls
    assert isinstance(acc.get_tracker("jsonl"), JSONLTracker)
    with pytest.raises(ValueError, match="'wandb' is not a tracker started.*recording.*jsonl"):
        acc.get_tracker("wandb")
    acc._finish_trackers()
    assert custom.calls == [("start",), ("config", {"lr": 0.1}), ("log", {"loss": 1.5}, 7, {"commit": True}),
                            ("finish",)]
    assert JSONLTracker.read(tmp_path / "proj")[0]["loss"] == 1.5
    assert acc.trackers == [] and isinstance(acc.get_tracker("jsonl"), GeneralTracker)


def test_init_trackers_twice_is_an_error_until_finished(tmp_path):
    acc = StandIn("jsonl", tmp_path)
    acc.init_trackers("proj")
    with pytest.raises(RuntimeError, match="already running.*end_training"):
        acc.init_trackers("proj")
    acc._finish_trackers()
    acc.init_trackers("proj")  # a new run after finishing is fine
    acc._finish_trackers()


def test_init_kwargs_must_be_dicts(tmp_path):
    acc = StandIn("jsonl", tmp_path)
    with pytest.raises(TypeError, match=r"init_kwargs\['jsonl'\] must be a dict"):
        acc.init_trackers("proj", init_kwargs={"jsonl": ["x"]})


def test_a_failing_start_finishes_the_trackers_already_started(tmp_path):
    class Broken(RecordingTracker):
        name = "broken"

        def start(self):
            raise OSError("disk full")

    first = RecordingTracker()
    acc = StandIn([first, Broken()], tmp_path)
    with pytest.raises(OSError, match="disk full"):
        acc.init_trackers("proj")
    assert first.calls == [("start",), ("finish",)] and acc.trackers == []


def test_no_trackers_get_tracker_is_blank_and_log_is_a_no_op():
    acc = StandIn(None)
    acc.init_trackers("proj", config={"a": 1})
    acc.log({"loss": 1.0}, step=1)
    assert repr(acc.get_tracker("tensorboard")) == "GeneralTracker(_blank=True)"
    acc._finish_trackers()


@pytest.mark.world_size(2)
def test_only_the_main_process_starts_and_writes(tmp_path):
    main_only = RecordingTracker(path=str(tmp_path / "main_only"))
    everywhere = RecordingTracker(path=str(tmp_path / "everywhere"), main_process_only=False)
    everywhere.name = "everywhere"
    acc = StandIn(["jsonl", main_only, everywhere], tmp_path)
    acc.init_trackers("proj", config={"lr": 0.5})
    acc.log({"loss": 2.0 + acc.state.process_index}, step=1)
    jsonl = acc.get_tracker("jsonl")
    if acc.state.is_main_process:
        assert isinstance(jsonl, JSONLTracker)
    else:
        assert repr(jsonl) == "GeneralTracker(_blank=True)" and jsonl.tracker is None
        assert repr(acc.get_tracker("recording", unwrap=True)) == "GeneralTracker(_blank=True)"
        assert acc.get_tracker("everywhere") is everywhere
    acc._finish_trackers()
    acc.state.wait_for_everyone()
    if acc.state.is_main_process:
        assert [(r["_step"], r["loss"]) for r in JSONLTracker.read(tmp_path / "proj")] == [(1, 2.0)]
        assert JSONLTracker.read_config(tmp_path / "proj") == {"lr": 0.5}
        assert os.path.exists(tmp_path / "main_only.rank0")
        assert not os.path.exists(tmp_path / "main_only.rank1")
        for rank in (0, 1):
            calls = [json.loads(line) for line in open(tmp_path / f"everywhere.rank{rank}")]
            assert calls == [["start"], ["config", {"lr": 0.5}], ["log", {"loss": 2.0 + rank}, 1, {}], ["finish"]]
