"""Aim, DVCLive, SwanLab and Trackio through their real packages, read back from what they wrote (issue 15, item 6).

Their packages pin older protobuf / pillow / filelock than hasten's environment holds, and DVCLive
brings DVC (about 57 packages), so they live in a separate environment, ``.tracker-venv``, that
``make test`` builds (``make tracker-venv``): it sees ``.venv``'s packages behind its own, so ``.venv``
is never downgraded. Each run happens in a child process of that interpreter; the files (and, for
Aim, the values its own reader returns) are checked here.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIG = {"lr": 0.05, "batch_size": 4, "optimizer": "sgd"}

_LOG = """
import json, sys
from hasten.tracking import {cls}
tracker = {cls}({args})
tracker.start()
tracker.store_init_configuration(json.loads(sys.argv[1]))
tracker.log({{"loss": 0.5, "acc": {{"train": 0.75}}}}, step=3)
tracker.log({{"loss": 0.25}}, step=6)
tracker.finish()
"""


def tracker_python(package: str) -> str:
    """The interpreter that has ``package``: this one, else the tracker environment ``make test`` builds."""
    if importlib.util.find_spec(package) is not None:
        return sys.executable
    candidate = Path(os.environ.get("HASTEN_TRACKER_PYTHON") or ROOT / ".tracker-venv" / "bin" / "python")
    if not candidate.exists():
        pytest.fail(f"{package} is not installed here and there is no tracker environment at {candidate}: "
                    "run `make tracker-venv` (`make test` builds it)")
    return str(candidate)


def _run(package: str, code: str, tmp_path: Path, **env: str) -> str:
    # cwd is a git repository of its own, with one commit: DVCLive runs `dvc init` at the enclosing git
    # root, which must not be hasten's checkout (pytest's basetemp sits inside it under `make test`), and
    # reads the current revision.
    git = ["git", "-C", str(tmp_path), "-c", "user.name=hasten", "-c", "user.email=hasten@localhost"]
    if not (tmp_path / ".git").exists():
        subprocess.run([*git, "init", "-q"], check=True)
        subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "start"], check=True)
    environment = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HOME": str(tmp_path), **env}
    proc = subprocess.run([tracker_python(package), "-c", code, json.dumps(CONFIG)], env=environment, cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_dvclive_writes_params_and_metrics(tmp_path):
    _run("dvclive", _LOG.format(cls="DVCLiveTracker", args=f"'demo', dir={str(tmp_path / 'dvc')!r}, "
                                                           "save_dvc_exp=False"), tmp_path, DVC_NO_ANALYTICS="1")
    assert yaml.safe_load((tmp_path / "dvc" / "params.yaml").read_text()) == CONFIG
    with open(tmp_path / "dvc" / "plots" / "metrics" / "loss.tsv") as handle:
        rows = list(csv.DictReader(handle, delimiter="\t"))
    assert [(int(r["step"]), float(r["loss"])) for r in rows] == [(3, 0.5), (6, 0.25)]
    assert json.loads((tmp_path / "dvc" / "metrics.json").read_text())["acc"] == {"train": 0.75}
    assert not (ROOT / ".dvc").exists()


def test_trackio_writes_its_local_database(tmp_path):
    # TRACKIO_DIR is read once, when trackio is imported: a fresh process per run.
    _run("trackio", _LOG.format(cls="TrackioTracker", args="'demo', name='run1'"), tmp_path,
         TRACKIO_DIR=str(tmp_path))
    with sqlite3.connect(next(tmp_path.rglob("demo.db"))) as database:
        metrics = [(step, json.loads(data)) for step, data in database.execute("select step, metrics from metrics")]
        config = json.loads(database.execute("select config from configs").fetchone()[0])
    assert metrics == [(3, {"loss": 0.5, "acc/train": 0.75}), (6, {"loss": 0.25})]
    assert {k: config[k] for k in CONFIG} == CONFIG


def test_swanlab_local_mode_writes_metrics_and_config(tmp_path):
    _run("swanlab", _LOG.format(cls="SwanLabTracker", args=f"'demo', mode='local', logdir={str(tmp_path)!r}"),
         tmp_path)
    run = next(tmp_path.glob("run-*"))
    config = yaml.safe_load((run / "files" / "config.yaml").read_text())
    assert {k: config[k]["value"] for k in CONFIG} == CONFIG
    logged = sorted((json.loads(line)["index"], json.loads(line)["data"])
                    for path in run.glob("logs/*/*.log") for line in path.read_text().splitlines())
    assert logged == [(3, 0.5), (3, 0.75), (6, 0.25)]


_AIM_READ = """
import json
import aim
from aim.storage.context import Context
from aim.sdk.index_manager import RepoIndexManager
repo = aim.Repo({repo!r})
(run_hash,) = repo.list_all_runs()
RepoIndexManager.get_index_manager(repo).index(run_hash)  # what `aim up` does in the background
run = repo.get_run(run_hash)
# data.items(): (step, (value, epoch, time)) in step order (values_list() alone is not step-aligned)
metrics = {{m.name: [[int(step), row[0]] for step, row in m.data.items()]
           for m in run.metrics() if not m.name.startswith("__system__")}}
note = run.get_text_sequence("note", Context({{}}))
texts = {{"note": [[int(step), row[0].data] for step, row in note.data.items()]}}
print(json.dumps({{"experiment": run.experiment, "hparams": run["hparams"], "metrics": metrics, "texts": texts}}))
"""


def test_aim_repository_reads_back_through_aim(tmp_path):
    repo = str(tmp_path / "aim")
    log = _LOG.format(cls="AimTracker", args=f"'demo', {repo!r}, system_tracking_interval=None")
    log = log.replace("tracker.finish()", "tracker.log({'note': 'warm-up done'}, step=6)\ntracker.finish()")
    _run("aim", log, tmp_path)
    read = json.loads(_run("aim", _AIM_READ.format(repo=repo), tmp_path).splitlines()[-1])
    assert read["experiment"] == "demo" and read["hparams"] == CONFIG
    assert read["metrics"] == {"loss": [[3, 0.5], [6, 0.25]], "acc/train": [[3, 0.75]]}
    assert read["texts"] == {"note": [[6, "warm-up done"]]}
