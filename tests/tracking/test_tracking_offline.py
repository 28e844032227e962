"""Comet and ClearML trackers in their offline modes, read back from what they wrote (issue 15, item 6).

Aim, DVCLive, SwanLab and Trackio are read back in tests/tracking/test_tracking_local.py (their packages live in
the separate tracker environment); here, what each tracker says when its package is missing.
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
    import sys

    monkeypatch.setitem(sys.modules, package, None)  # `import package` fails, as where it is not installed
    instance = tracker("demo", tmp_path) if tracker is AimTracker else tracker("demo")
    with pytest.raises(MissingDependencyError, match=rf"pip install 'hasten\[{package}\]'"):
        instance.start()
