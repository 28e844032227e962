"""``hasten launch`` end to end in subprocesses (marked ``launch``; each costs a few seconds)."""

import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.launch

REPORT = """
import json, os, sys
from hasten import PartialState
s = PartialState()
cfg = json.loads(os.environ["HASTEN_LAUNCH_CONFIG"])
print(f"rank={s.process_index} world={s.num_processes} args={sys.argv[1:]} cpu={cfg['use_cpu']}", flush=True)
"""


def _env(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", HASTEN_HOME=str(tmp_path / "home"),
               TMPDIR=str(tmp_path))
    env.pop("HASTEN_LAUNCH_CONFIG", None)
    return env


def _hasten(tmp_path, *argv, timeout=120):
    return subprocess.Popen([sys.executable, "-m", "hasten.commands.main", *argv], cwd=tmp_path, env=_env(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _run(tmp_path, *argv, timeout=120):
    proc = _hasten(tmp_path, *argv)
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def _script(tmp_path, body, name="script.py"):
    path = tmp_path / name
    path.write_text(body)
    return str(path)


def test_cpu_two_processes_see_the_script_arguments(tmp_path):
    code, out = _run(tmp_path, "launch", "--cpu", "--num_processes", "2", _script(tmp_path, REPORT), "--x", "1")
    assert code == 0, out
    assert "rank=0 world=2 args=['--x', '1'] cpu=True" in out and "rank=1 world=2 args=['--x', '1'] cpu=True" in out


@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_two_machines_form_one_group(tmp_path, backend):
    from hasten.environments import find_free_port

    script = _script(tmp_path, REPORT)
    port = str(find_free_port())
    common = ["launch", "--cpu", "--num_machines", "2", "--num_processes", "2", "--main_process_ip", "127.0.0.1",
              "--main_process_port", port, "--rdzv_backend", backend]
    nodes = [_hasten(tmp_path, *common, "--machine_rank", str(rank), script) for rank in (0, 1)]
    outs = [node.communicate(timeout=120)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outs
    joined = "".join(outs)
    assert "rank=0 world=2" in joined and "rank=1 world=2" in joined


@pytest.mark.serial  # a 10 s wall-clock bound: run alone, after the parallel part of make test
def test_failing_worker_stops_the_run_quickly_with_its_traceback(tmp_path):
    body = ("from hasten import PartialState\ns = PartialState()\n"
            "if s.process_index == 1:\n    raise ValueError('rank one is broken')\ns.wait_for_everyone()\n"
            "import time; time.sleep(60)\n")
    start = time.monotonic()
    code, out = _run(tmp_path, "launch", "--cpu", "--num_processes", "2", _script(tmp_path, body))
    assert code != 0 and time.monotonic() - start < 10, out
    assert "ValueError: rank one is broken" in out and "worker(s) failed" in out
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "script.py")], capture_output=True, text=True).stdout
    assert left.strip() == "", "worker processes were left running"


def test_max_restarts_recovers_from_one_failure(tmp_path):
    marker = tmp_path / "failed-once"
    body = ("import sys, pathlib\nfrom hasten import PartialState\ns = PartialState()\nm = pathlib.Path(sys.argv[1])\n"
            "if s.process_index == 1 and not m.exists():\n    m.touch()\n    raise RuntimeError('first try')\n"
            "s.wait_for_everyone()\nprint(f'done {s.process_index}', flush=True)\n")
    code, out = _run(tmp_path, "launch", "--cpu", "--num_processes", "2", "--max_restarts", "1",
                     _script(tmp_path, body), str(marker))
    assert code == 0, out
    assert marker.exists() and "done 0" in out and "done 1" in out


def test_hasten_test_passes_with_one_and_two_processes(tmp_path):
    for n in ("1", "2"):
        code, out = _run(tmp_path, "test", "--cpu", "--num_processes", n)
        assert code == 0, out
        assert out.rstrip().endswith("Test is a success! You are ready for your distributed training!"), out
        assert f"{n} process(es)" in out


def test_plain_torchrun_standalone_gives_two_processes(tmp_path):
    """Acceptance from the foundation: a script under torchrun sees 2 processes on CPU."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           _script(tmp_path, REPORT.replace("cfg = json.loads(os.environ[\"HASTEN_LAUNCH_CONFIG\"])",
                                                            "cfg = {'use_cpu': None}"))],
                          cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "rank=0 world=2" in proc.stdout and "rank=1 world=2" in proc.stdout


@pytest.mark.slow
@pytest.mark.serial  # two launches at a time already; under a parallel suite one failed at gloo connect (see note)
def test_fifteen_consecutive_two_process_runs_all_exit_zero(tmp_path):
    """From the foundation's acceptance: create PartialState() and return, never a gloo abort at exit.

    Without the group destroyed before exit, 10-20% of 2-process runs abort: 15 runs catch that with
    80-96% probability, and the suite's other 2-process launches (over a hundred) all check exit 0 too.
    (The foundation ran 30 here; halved for the suite's time budget.)
    """
    script = _script(tmp_path, "from hasten import PartialState\nPartialState()\n")
    runs = [tmp_path / f"run{i}" for i in range(15)]
    for folder in runs:
        folder.mkdir()

    def once(folder: Path):
        return _run(folder, "launch", "--cpu", "--num_processes", "2", script)

    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=2) as pool:  # two launches at a time on two cores
        results = list(pool.map(once, runs))
    failures = [out for code, out in results if code != 0]
    assert not failures, failures[0]
    print(f"{len(runs)} launches in {time.monotonic() - start:.1f} s")


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed (apt-get install openmpi-bin)")
def test_mpirun_runs_two_ranks(tmp_path):
    env_extra = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    proc = subprocess.run([sys.executable, "-m", "hasten.commands.main", "launch", "--use_mpi", "--cpu",
                           "--num_processes", "2", _script(tmp_path, REPORT)],
                          cwd=tmp_path, env={**_env(tmp_path), **env_extra}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank=0 world=2" in proc.stdout and "rank=1 world=2" in proc.stdout
