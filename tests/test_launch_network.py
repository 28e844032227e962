"""A single-machine ``hasten launch`` listens on loopback only (launcher's rendezvous store and workers)."""

import os
import subprocess
import sys
import time

import psutil
import pytest

pytestmark = [pytest.mark.launch]

WAIT_FOR_GO = """
import os, sys, time
from hasten import PartialState
state = PartialState()
state.wait_for_everyone()  # every listener of the process group exists now
open(os.path.join(sys.argv[1], f"ready{state.process_index}"), "w").close()
deadline = time.monotonic() + 60
while not os.path.exists(os.path.join(sys.argv[1], "go")) and time.monotonic() < deadline:
    time.sleep(0.05)
state.wait_for_everyone()
"""


def _listening(pids):
    return [(c.pid, c.laddr.ip, c.laddr.port) for c in psutil.net_connections("inet")
            if c.pid in pids and c.status == psutil.CONN_LISTEN]


@pytest.mark.parametrize("extra", [[], ["--rdzv_backend", "c10d"], ["--max_restarts", "1"]],
                         ids=["static", "c10d", "c10d-restarts"])
def test_single_machine_launch_listens_on_loopback_only(tmp_path, extra):
    script = tmp_path / "wait.py"
    script.write_text(WAIT_FOR_GO)
    env = dict(os.environ, OMP_NUM_THREADS="1", HASTEN_HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path))
    env.pop("GLOO_SOCKET_IFNAME", None)  # the launcher must choose the interface itself
    launcher = subprocess.Popen([sys.executable, "-m", "hasten.commands.main", "launch", "--cpu", "--num_processes",
                                 "2", *extra, str(script), str(tmp_path)], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)):
            assert launcher.poll() is None, launcher.communicate()[0]
            assert time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.05)
        tree = {launcher.pid, *(p.pid for p in psutil.Process(launcher.pid).children(recursive=True))}
        sockets = _listening(tree)
        (tmp_path / "go").touch()
        out, _ = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, out
    # The rendezvous store (launcher, or worker rank 0 with c10d) and each worker's gloo listener.
    assert len(sockets) >= 3, sockets
    assert {ip for _, ip, _ in sockets} == {"127.0.0.1"}, sockets


NOTEBOOK = """
import sys
from hasten.launchers.notebook import notebook_launcher

def wait(folder):
    exec(open(folder + "/wait.py").read().replace("sys.argv[1]", repr(folder)))

if __name__ == "__main__":
    notebook_launcher(wait, args=(sys.argv[1],), num_processes=2, rdzv_backend=sys.argv[2])
"""


def _sockets_of_a_running_pair(tmp_path, command):
    """Start ``command`` (two ranks running WAIT_FOR_GO), return the listening sockets of its process tree."""
    (tmp_path / "wait.py").write_text(WAIT_FOR_GO)
    env = dict(os.environ, OMP_NUM_THREADS="1", HASTEN_HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path),
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.pop("GLOO_SOCKET_IFNAME", None)  # the launcher must choose the interface itself
    launcher = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)):
            assert launcher.poll() is None, launcher.communicate()[0]
            assert time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.05)
        tree = {p.pid: " ".join(p.cmdline()) for p in [psutil.Process(launcher.pid),
                                                        *psutil.Process(launcher.pid).children(recursive=True)]}
        sockets = [(tree[pid], ip, port) for pid, ip, port in _listening(set(tree))]
        (tmp_path / "go").touch()
        out, _ = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, out
    return sockets


@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_notebook_launcher_listens_on_loopback_only(tmp_path, backend):
    (tmp_path / "nb.py").write_text(NOTEBOOK)
    sockets = _sockets_of_a_running_pair(tmp_path, [sys.executable, str(tmp_path / "nb.py"), str(tmp_path), backend])
    assert len(sockets) >= 3, sockets  # the rendezvous store and each rank's gloo listener
    assert {ip for _, ip, _ in sockets} == {"127.0.0.1"}, sockets


@pytest.mark.skipif(__import__("shutil").which("mpirun") is None, reason="mpirun not installed")
def test_single_machine_mpirun_listens_on_loopback_only(tmp_path):
    sockets = _sockets_of_a_running_pair(tmp_path, [
        sys.executable, "-m", "hasten.commands.main", "launch", "--use_mpi", "--cpu", "--num_processes", "2",
        str(tmp_path / "wait.py"), str(tmp_path)])
    # The process group's store (rank 0) and each rank's gloo listener; mpirun's own daemons are MPI's.
    workers = [s for s in sockets if "hasten.launchers.worker" in s[0] and "mpi" not in s[0].split()[0]]
    assert len(workers) >= 3, sockets
    assert {ip for _, ip, _ in workers} == {"127.0.0.1"}, sockets
