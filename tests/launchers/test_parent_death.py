"""Launcher workers die with the launcher (issue 18, item 7): SIGKILL ``hasten launch``, the workers go too.

Linux's parent-death signal (``PR_SET_PDEATHSIG``) is what makes this hold; the test polls with a
deadline for the worker processes to disappear (a zombie counts as gone), no fixed sleeps.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

WAIT_FOREVER = """
import os, sys, threading
from hasten import PartialState
s = PartialState()
open(os.path.join(sys.argv[1], f"pid{s.process_index}.tmp"), "w").write(str(os.getpid()))
os.replace(os.path.join(sys.argv[1], f"pid{s.process_index}.tmp"), os.path.join(sys.argv[1], f"pid{s.process_index}"))
threading.Event().wait()
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _poll(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.mark.launch
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
@pytest.mark.parametrize("num_processes", ["1", "2"])
def test_workers_die_when_the_launcher_is_killed(tmp_path, num_processes):
    script = tmp_path / "wait.py"
    script.write_text(WAIT_FOREVER)
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", HASTEN_HOME=str(tmp_path / "home"))
    env.pop("HASTEN_LAUNCH_CONFIG", None)
    launcher = subprocess.Popen([sys.executable, "-m", "hasten.commands.main", "launch", "--cpu", "--num_processes",
                                 num_processes, str(script), str(tmp_path)], cwd=tmp_path, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    files = [tmp_path / f"pid{r}" for r in range(int(num_processes))]
    try:
        assert _poll(lambda: all(f.exists() for f in files), 120), "the workers did not start"
        pids = [int(f.read_text()) for f in files]
        assert all(_alive(p) for p in pids) and launcher.pid not in pids
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)
        assert _poll(lambda: not any(_alive(p) for p in pids), 30), f"workers {pids} outlived the launcher"
    finally:
        launcher.kill()
        for f in files:
            if f.exists() and _alive(int(f.read_text())):
                os.kill(int(f.read_text()), signal.SIGKILL)
