"""A single-machine ``hasten launch`` listens on loopback only (launcher's rendezvous store and workers)."""

import json
import os
import re
import select
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


MPI_JOB = """
import json, os, sys
from hasten import PartialState
state = PartialState()
state.wait_for_everyone()  # every listener of the process group exists now
if state.process_index == 0:
    contacts = {k: v for k, v in os.environ.items() if k in ("OMPI_MCA_orte_hnp_uri", "OMPI_MCA_orte_local_daemon_uri")
                or k.startswith("PMIX_SERVER_URI")}
    with open(sys.argv[1], "w") as ready:  # a FIFO the test reads while the run is alive
        ready.write(json.dumps({"pid": os.getpid(), "contacts": contacts}) + "\\n")
    with open(sys.argv[2]) as go:  # the test writes a line once it has listed the sockets
        go.readline()
state.wait_for_everyone()
"""


def _read_line(fd, launcher, seconds):
    """One line from the non-blocking FIFO ``fd``, waiting on it (select) while the launcher runs."""
    data, deadline = b"", time.monotonic() + seconds
    while not data.endswith(b"\n"):
        assert launcher.poll() is None, launcher.communicate()[0]
        remaining = deadline - time.monotonic()
        assert remaining > 0, "the job never wrote its line"
        if select.select([fd], [], [], min(remaining, 1.0))[0]:
            chunk = os.read(fd, 65536)
            assert chunk, "the job closed the FIFO without a line"
            data += chunk
    return json.loads(data)


def _addresses(uri):
    """The host addresses of an Open MPI / PMIx contact URI (``jobid;tcp://1.2.3.4:5;tcp6://[::1]:6``)."""
    return [v6 or v4 for v6, v4 in re.findall(r"//(?:\[([^\]]+)\]|([^:/;\[]+)):\d+", uri)]


@pytest.mark.skipif(__import__("shutil").which("mpirun") is None, reason="mpirun not installed")
def test_single_machine_mpirun_keeps_mpi_on_loopback(tmp_path):
    script, ready, go = tmp_path / "job.py", tmp_path / "ready", tmp_path / "go"
    script.write_text(MPI_JOB)
    os.mkfifo(ready)
    os.mkfifo(go)
    env = dict(os.environ, OMP_NUM_THREADS="1", HASTEN_HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path),
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    for name in [k for k in env if k == "GLOO_SOCKET_IFNAME" or k.startswith("OMPI_MCA_")]:
        del env[name]  # the launcher chooses the interfaces itself
    ready_fd = os.open(ready, os.O_RDONLY | os.O_NONBLOCK)
    go_fd = os.open(go, os.O_RDWR)  # never blocks; rank 0 reads its line from it
    launcher = subprocess.Popen([sys.executable, "-m", "hasten.commands.main", "launch", "--use_mpi", "--cpu",
                                 "--num_processes", "2", str(script), str(ready), str(go)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        job = _read_line(ready_fd, launcher, 120)
        tree = {p.pid: p.cmdline() for p in [psutil.Process(launcher.pid),
                                             *psutil.Process(launcher.pid).children(recursive=True)]}
        sockets = [(pid, ip, port) for pid, ip, port in _listening(set(tree))]
        os.write(go_fd, b"go\n")
        out, _ = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
        os.close(ready_fd)
        os.close(go_fd)
    assert launcher.returncode == 0, out
    # mpirun tells every process to reach it (its out-of-band channel and PMIx server) on loopback only
    contacts = job["contacts"]
    assert "OMPI_MCA_orte_hnp_uri" in contacts or "PMIX_SERVER_URI41" in contacts, contacts
    assert {a for uri in contacts.values() for a in _addresses(uri)} == {"127.0.0.1"}, contacts
    mpi = [s for s in sockets if os.path.basename(tree[s[0]][0]) in ("mpirun", "mpiexec", "orterun", "prterun")]
    # hasten's listeners (rank 0's store, each rank's gloo connections): loopback
    hasten = [s for s in sockets if s not in mpi]
    assert len(hasten) >= 3 and {ip for _, ip, _ in hasten} == {"127.0.0.1"}, sockets
    # mpirun's own: loopback, except its out-of-band listeners, which Open MPI 4 and 5 bind to the wildcard
    # address whatever the settings (oob_tcp_listener.c); no process is told to connect to them but on loopback
    wildcard = [(ip, port) for _, ip, port in mpi if ip in ("0.0.0.0", "::")]
    advertised = {int(port) for uri in contacts.values() for port in re.findall(r":(\d+)(?:;|$)", uri)}
    assert {ip for _, ip, _ in mpi} <= {"127.0.0.1", "0.0.0.0", "::"}, sockets
    assert len(wildcard) <= 2 and all(port in advertised for ip, port in wildcard if ip == "0.0.0.0"), sockets
