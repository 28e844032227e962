"""Comet and ClearML trackers in their offline modes, read back from what they wrote (issue 15, item 6).

Aim, DVCLive, SwanLab and Trackio are built in too; their packages are heavy or pin older versions of
packages hasten's own environment uses, so they are not in the dev extra and their tests run only
where the package is installed.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from hasten import Accelerator
from hasten.exceptions import MissingDependencyError
from hasten.tracking import AimTracker, DVCLiveTracker, SwanLabTracker, TrackioTracker

CONFIG = {"lr": 0.05, "batch_size": 4, "optimizer": "sgd"}


def _log_a_run(name: str, init_kwargs: dict) -> Accelerator:
    accelerator = Accelerator(cpu=True, log_with=name)
    accelerator.init_trackers("demo", config=CONFIG, init_kwargs={name: init_kwargs})
    accelerator.log({"loss": 0.5, "acc": {"train": 0.75}}, step=3)
    accelerator.log({"loss": 0.25}, step=6)
    return accelerator


def test_comet_offline_run_reads_back(tmp_path, monkeypatch):
    comet_ml = pytest.importorskip("comet_ml")
    monkeypatch.delenv("COMET_API_KEY", raising=False)
    monkeypatch.setenv("COMET_DISABLE_AUTO_LOGGING", "1")
    config = comet_ml.ExperimentConfig(offline_directory=str(tmp_path), display_summary_level=0,
                                       log_code=False, log_env_details=False, log_git_metadata=False)
    accelerator = _log_a_run("comet_ml", {"online": False, "experiment_config": config})
    accelerator.log({"note": "warm-up done"}, step=6)
    accelerator.end_training()
    archive = next(tmp_path.glob("*.zip"))
    with zipfile.ZipFile(archive) as zipped:
        messages = [json.loads(line) for line in zipped.read("messages.json").decode().splitlines()]
    metrics = [(m["payload"]["metric"]["metricName"], m["payload"]["metric"]["step"],
                m["payload"]["metric"]["metricValue"]) for m in messages if m["type"] == "metric_msg"]
    assert ("loss", 3, 0.5) in metrics and ("loss", 6, 0.25) in metrics and ("acc/train", 3, 0.75) in metrics
    params = {m["payload"]["param"]["paramName"]: m["payload"]["param"]["paramValue"]
              for m in messages if m["type"] == "parameter_msg" and m["payload"]["param"]["source"] == "manual"}
    params.pop("curr_step", None)  # Comet records set_step() as a parameter too
    assert params == CONFIG
    others = {m["payload"]["key"]: m["payload"]["value"] for m in messages if m["type"] == "log_other"}
    assert others["note"] == "warm-up done"


_CLEARML_RUN = """
import json, sys
from clearml import Task
from hasten import Accelerator
Task.set_offline(offline_mode=True)
Task.force_store_standalone_script()  # no repository scan (the test folder sits inside hasten's checkout)
accelerator = Accelerator(cpu=True, log_with="clearml")
accelerator.init_trackers("demo", config=json.loads(sys.argv[1]), init_kwargs={"clearml": {
    "auto_connect_frameworks": False, "auto_resource_monitoring": False, "auto_connect_streams": False,
    "auto_connect_arg_parser": False}})
accelerator.log({"loss": 0.5, "acc": {"train": 0.75}}, step=3)
accelerator.log({"loss": 0.25}, step=6)
accelerator.log({"final_accuracy": 0.9})
print(accelerator.get_tracker("clearml", unwrap=True).get_offline_mode_folder())
accelerator.end_training()
"""


@pytest.mark.slow
def test_clearml_offline_run_reads_back(tmp_path):
    import os
    import subprocess
    import sys

    pytest.importorskip("clearml")
    # A separate process: ClearML patches the interpreter it runs in (exit hooks, reporting threads).
    env = {**os.environ, "HOME": str(tmp_path), "CLEARML_OFFLINE_MODE": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    script = tmp_path / "clearml_run.py"
    script.write_text(_CLEARML_RUN)
    out = subprocess.run([sys.executable, str(script), json.dumps(CONFIG)], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=180, check=True)
    folder = Path(next(line.strip() for line in out.stdout.splitlines() if line.startswith("/")))
    lines = [r for line in (folder / "metrics.jsonl").read_text().splitlines() for r in json.loads(line)]
    scalars = {(r["metric"], r["variant"], r["iter"]): r["value"] for r in lines}
    assert scalars[("loss", "loss", 3)] == 0.5 and scalars[("loss", "loss", 6)] == 0.25
    assert scalars[("acc", "train", 3)] == 0.75
    assert scalars[("Summary", "final_accuracy", -2**31)] == 0.9
    stored = json.loads((folder / "task.json").read_text())["configuration"]["General"]["value"]
    assert stored.splitlines() == [f"{key} = {json.dumps(value)}" for key, value in CONFIG.items()]


@pytest.mark.parametrize("tracker,package", [(AimTracker, "aim"), (DVCLiveTracker, "dvclive"),
                                             (SwanLabTracker, "swanlab"), (TrackioTracker, "trackio")])
def test_trackers_without_their_package_name_the_pip_command(tracker, package, tmp_path, monkeypatch):
    import importlib.util

    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here")
    instance = tracker("demo", tmp_path) if tracker is AimTracker else tracker("demo")
    with pytest.raises(MissingDependencyError, match=rf"pip install 'hasten\[{package}\]'"):
        instance.start()


# ---------------------------------------------------------- where their packages are installed (not in dev)
def _run_tracker(tracker) -> None:
    tracker.start()
    tracker.store_init_configuration(CONFIG)
    tracker.log({"loss": 0.5, "acc": {"train": 0.75}}, step=3)
    tracker.log({"loss": 0.25}, step=6)
    tracker.finish()


def test_dvclive_writes_params_and_metrics(tmp_path, monkeypatch):
    pytest.importorskip("dvclive")
    monkeypatch.chdir(tmp_path)  # DVCLive writes dvc.yaml in the current folder
    import csv

    import yaml

    _run_tracker(DVCLiveTracker("demo", dir=str(tmp_path / "dvc"), save_dvc_exp=False))
    assert yaml.safe_load((tmp_path / "dvc" / "params.yaml").read_text()) == CONFIG
    with open(tmp_path / "dvc" / "plots" / "metrics" / "loss.tsv") as handle:
        rows = list(csv.DictReader(handle, delimiter="\t"))
    assert [(int(r["step"]), float(r["loss"])) for r in rows] == [(3, 0.5), (6, 0.25)]
    assert json.loads((tmp_path / "dvc" / "metrics.json").read_text())["acc"] == {"train": 0.75}


def test_trackio_writes_its_local_database(tmp_path):
    import importlib.util
    import os
    import sqlite3
    import subprocess
    import sys

    if importlib.util.find_spec("trackio") is None:
        pytest.skip("trackio is not installed")
    # A fresh process: trackio reads TRACKIO_DIR once, when it is imported.
    code = ("import json, sys\nfrom hasten.tracking import TrackioTracker\n"
            "t = TrackioTracker('demo', name='run1')\nt.start()\nt.store_init_configuration(json.loads(sys.argv[1]))\n"
            "t.log({'loss': 0.5, 'acc': {'train': 0.75}}, step=3)\nt.log({'loss': 0.25}, step=6)\nt.finish()\n")
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path), "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code, json.dumps(CONFIG)], env=env, cwd=tmp_path, capture_output=True,
                   timeout=120, check=True)
    with sqlite3.connect(next(tmp_path.rglob("demo.db"))) as database:
        metrics = [(step, json.loads(data)) for step, data in database.execute("select step, metrics from metrics")]
        config = json.loads(database.execute("select config from configs").fetchone()[0])
    assert metrics == [(3, {"loss": 0.5, "acc/train": 0.75}), (6, {"loss": 0.25})]
    assert {k: config[k] for k in CONFIG} == CONFIG


def test_swanlab_local_mode_writes_metrics_and_config(tmp_path):
    pytest.importorskip("swanlab")
    import yaml

    _run_tracker(SwanLabTracker("demo", mode="local", logdir=str(tmp_path)))
    run = next(tmp_path.glob("run-*"))
    config = yaml.safe_load((run / "files" / "config.yaml").read_text())
    assert {k: config[k]["value"] for k in CONFIG} == CONFIG
    logged = sorted((json.loads(line)["index"], json.loads(line)["data"])
                    for path in run.glob("logs/*/*.log") for line in path.read_text().splitlines())
    assert logged == [(3, 0.5), (3, 0.75), (6, 0.25)]
