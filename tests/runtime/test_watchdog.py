"""Bounded hangs: a rank stuck in a collective past the bound makes every rank report and the run stop."""

import datetime
import os
import subprocess
import sys

import pytest
import torch

from hasten import PartialState
from hasten.config.env import collective_timeout
from hasten.runtime.watchdog import HANG_EXIT_CODE, process_group_timeout

HANG = """
import datetime, sys, threading
import torch
from hasten import Accelerator
from hasten.utils import InitProcessGroupKwargs
handlers = [InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=float(sys.argv[1])))] if sys.argv[1:] else []
acc = Accelerator(cpu=True, kwargs_handlers=handlers)
acc.gather(torch.ones(2))  # a matching collective first: it shows in the history
if acc.process_index == acc.num_processes - 1:
    threading.Event().wait(120)  # HANG-LINE: this rank never reaches the next collective
elif acc.process_index == 0:
    acc.gather(torch.ones(3))
else:
    acc.wait_for_everyone()
"""


def _launch(tmp_path, nproc, *args):
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    env = dict(os.environ, OMP_NUM_THREADS="1", HASTEN_HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "hasten.commands.main", "launch", "--cpu", "--num_processes",
                           str(nproc), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr, str(script)


@pytest.mark.launch
def test_launch_option_bound_reports_every_rank_and_stops_the_run(tmp_path):
    code, out, script = _launch(tmp_path, 3, "--collective_timeout", "3", str(tmp_path / "hang.py"))
    assert code == HANG_EXIT_CODE, out
    hang_line = HANG.splitlines().index("    threading.Event().wait(120)  # HANG-LINE: this rank never reaches "
                                        "the next collective") + 1
    assert "waited in a collective for more than 3 s. What each rank was doing:" in out
    assert f"  rank 0: in `gather` with shape (3,) float32 at {script}:" in out, out
    assert f"  rank 1: in `wait_for_everyone` with no tensors at {script}:" in out, out
    assert f"  rank 2: not in a hasten collective; running {script}:{hang_line} in <module>" in out, out
    assert "rank 2's last collectives:\n    `gather` with shape (2,) float32" in out
    assert out.count("What each rank was doing") == 1  # one full report, one line from each other rank
    assert "hasten watchdog (rank 1): stopping the run" in out and "hasten watchdog (rank 2): stopping" in out
    assert "stopped by hasten's hang watchdog" in out


@pytest.mark.launch
def test_init_process_group_kwargs_timeout_sets_the_bound(tmp_path):
    script = str(tmp_path / "hang.py")
    code, out, _ = _launch(tmp_path, 2, script, "2")
    assert code == HANG_EXIT_CODE, out
    assert "more than 2 s" in out and "  rank 0: in `gather` with shape (3,) float32" in out
    assert "  rank 1: not in a hasten collective; running" in out


def test_bound_settings():
    assert collective_timeout({}) is None
    assert collective_timeout({"HASTEN_COLLECTIVE_TIMEOUT": "2.5"}) == datetime.timedelta(seconds=2.5)
    with pytest.raises(ValueError, match="HASTEN_COLLECTIVE_TIMEOUT='0'"):
        collective_timeout({"HASTEN_COLLECTIVE_TIMEOUT": "0"})
    bound = datetime.timedelta(minutes=5)
    assert bound < process_group_timeout(bound) <= bound + datetime.timedelta(seconds=90)


def test_bad_collective_timeout_exits_2(tmp_path, capsys):
    from hasten.commands.main import main

    script = tmp_path / "t.py"
    script.write_text("")
    assert main(["launch", "--cpu", "--num_processes", "2", "--collective_timeout", "0", str(script)]) == 2
    assert "--collective_timeout=0.0 must be a number of seconds above 0" in capsys.readouterr().err


@pytest.mark.world_size(2, env={"HASTEN_DEBUG_MODE": "1"})
def test_debug_mode_bounds_a_missing_rank_by_60_seconds_by_default():
    from hasten.runtime import debug_checks as debug, watchdog

    state = PartialState()
    assert state.debug and state.timeout == datetime.timedelta(minutes=5)
    assert debug._CONFIG.timeout == datetime.timedelta(seconds=60)  # monitored_barrier names a missing rank
    running = watchdog._RUNNING["default"]
    assert running.is_alive() and running.bound == 360  # after debug mode's own report, never before it


SKIPPED_STEP = """
import threading
import torch
from torch import nn
from hasten import Accelerator
acc = Accelerator(cpu=True)
model, optimizer = acc.prepare(nn.Linear(2, 1), torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1))
for step in range(3):
    if acc.process_index == 1 and step == 2:
        threading.Event().wait(120)  # SKIP-LINE: this rank never runs the third step
    acc.backward(model(torch.ones(4, 2)).sum())
"""


@pytest.mark.launch
def test_a_rank_skipping_a_step_is_named_while_the_other_waits_in_backward(tmp_path):
    script = tmp_path / "skip.py"
    script.write_text(SKIPPED_STEP)
    env = dict(os.environ, OMP_NUM_THREADS="1", HASTEN_HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "hasten.commands.main", "launch", "--cpu", "--num_processes", "2",
                           "--collective_timeout", "3", str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == HANG_EXIT_CODE, out
    skip_line = SKIPPED_STEP.splitlines().index(
        "        threading.Event().wait(120)  # SKIP-LINE: this rank never runs the third step") + 1
    assert f"  rank 0: in `backward (gradient all-reduce)` with no tensors at {script}:" in out, out
    assert f"  rank 1: not in a hasten collective; running {script}:{skip_line} in <module>" in out, out


def test_tracker_reports_the_user_line_that_entered_the_collective():
    from hasten.runtime import watchdog

    tracker = watchdog._Tracker()
    line = sys._getframe().f_lineno + 1
    tracker.enter("gather", torch.ones(3))
    name, what, site, _ = tracker.current
    expected = f"`gather` with shape (3,) float32 at {os.path.abspath(__file__)}:{line} in {sys._getframe().f_code.co_name}"
    assert watchdog._described(name, what, site) == expected
    tracker.exit()
    assert tracker.current is None and [entry[0] for entry in tracker.recent] == ["gather"]
