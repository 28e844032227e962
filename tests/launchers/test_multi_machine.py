"""Several machines for real: one network namespace per machine, each with its own address.

``hasten launch --num_machines N --machine_rank i --main_process_ip <machine 0>`` runs in each namespace,
2 processes per machine. Needs root and iproute2 (skipped with the reason otherwise).
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import hasten.testing
from hasten.testing.netns import netns_unavailable, simulated_machines

pytestmark = [pytest.mark.launch]
_WHY_NOT = netns_unavailable()
needs_netns = pytest.mark.skipif(_WHY_NOT is not None, reason=f"simulated machines unavailable: {_WHY_NOT}")

TRAIN = str(Path(hasten.testing.__file__).parent / "scripts" / "regression_train.py")


def _env(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", HASTEN_HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path),
               PYTHONUNBUFFERED="1")
    env.pop("GLOO_SOCKET_IFNAME", None)  # each launcher must find its machine's interface itself
    return env


def _script(tmp_path):
    (tmp_path / "out").mkdir(exist_ok=True)
    return TRAIN


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The weights one process reaches with the whole global batch (computed once for the module)."""
    ref = tmp_path_factory.mktemp("reference")
    done = subprocess.run([sys.executable, TRAIN, str(ref), "12", "-1"], env=_env(ref), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads((ref / "rank0.json").read_text())["weights"]


# Fixed ports are safe here: each test's namespaces are new and hold nothing else.
def _launch_all(machines, tmp_path, script, extra=(), crash_rank=-1, global_batch=12):
    procs = []
    for rank, machine in enumerate(machines):
        argv = [sys.executable, "-m", "hasten.commands.main", "launch", "--cpu", "--num_machines", str(len(machines)),
                "--machine_rank", str(rank), "--num_processes", str(2 * len(machines)), "--main_process_ip",
                machines[0].ip, "--main_process_port", "29511", *extra, script, str(tmp_path / "out"),
                str(global_batch), str(crash_rank)]
        procs.append(machine.popen(argv, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    return procs


def _wait_all(procs, timeout=150):
    outs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        outs.append(out)
    return [p.returncode for p in procs], outs


@needs_netns
@pytest.mark.parametrize(("count", "backend"), [(2, "static"), (3, "c10d")],
                         ids=["2-machines-static", "3-machines-c10d"])
def test_namespaced_machines_train_like_one_process(tmp_path, reference, count, backend):
    script = _script(tmp_path)
    with simulated_machines(count) as machines:
        codes, outs = _wait_all(_launch_all(machines, tmp_path, script, ["--rdzv_backend", backend]))
        assert codes == [0] * count, "\n".join(outs)
    results = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in range(2 * count)]
    assert all(r["world"] == 2 * count for r in results)
    for r in results:
        assert r["weights"] == pytest.approx(reference, abs=1e-5)
    # Each machine listens only on its own address: the one facing machine 0, never 0.0.0.0.
    for rank, machine in enumerate(machines):
        assert results[2 * rank]["listening"] == [machine.ip], (rank, results[2 * rank])


@needs_netns
def test_a_crash_on_one_machine_stops_every_machine(tmp_path):
    script = _script(tmp_path)
    with simulated_machines(2) as machines:
        procs = _launch_all(machines, tmp_path, script, crash_rank=3)
        codes, outs = _wait_all(procs)
        stopped = time.time()
    assert codes[0] != 0 and codes[1] != 0, "\n".join(outs)
    assert "RuntimeError: rank 3 fails on purpose" in outs[1]  # the traceback, on the machine that crashed
    crash_at = float(outs[1].split("crash-at ")[1].split()[0])
    print(f"failure-to-stop across machines: {stopped - crash_at:.1f} s")  # reported by the note


@needs_netns
@pytest.mark.parametrize("present", [0, 1], ids=["worker-machine-missing", "main-machine-missing"])
def test_a_machine_that_never_arrives_gives_a_rendezvous_timeout(tmp_path, present):
    script = _script(tmp_path)
    with simulated_machines(2) as machines:
        machine = machines[present]
        argv = [sys.executable, "-m", "hasten.commands.main", "launch", "--cpu", "--num_machines", "2",
                "--machine_rank", str(present), "--num_processes", "4", "--main_process_ip", machines[0].ip,
                "--main_process_port", "29512", "--rdzv_conf", "timeout=4", script, str(tmp_path / "out"), "8", "-1"]
        proc = machine.popen(argv, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, out
    assert f"the machines could not meet at {machines[0].ip}:29512" in out, out


@needs_netns
def test_max_restarts_with_c10d_recovers_across_machines_from_the_newest_checkpoint(tmp_path):
    import torch

    from helpers.launch_scripts import RESUMING_TRAINER as SCRIPT  # the single-machine restart test's script

    script = tmp_path / "resume.py"
    script.write_text(SCRIPT)
    marker = tmp_path / "crashed"
    with simulated_machines(2) as machines:
        procs = []
        for rank, machine in enumerate(machines):
            argv = [sys.executable, "-m", "hasten.commands.main", "launch", "--cpu", "--num_machines", "2",
                    "--machine_rank", str(rank), "--num_processes", "4", "--main_process_ip", machines[0].ip,
                    "--main_process_port", "29513", "--rdzv_backend", "c10d", "--max_restarts", "1", str(script),
                    str(tmp_path / "a"), str(tmp_path / "a.pt"), str(marker)]
            procs.append(machine.popen(argv, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        codes, outs = _wait_all(procs, timeout=240)
    assert codes == [0, 0], "\n".join(outs)
    assert marker.exists() and "resumed from checkpoint_1" in "".join(outs)
    # Uninterrupted reference: the same 4 processes on one machine, no crash.
    clean = subprocess.run([sys.executable, "-m", "hasten.commands.main", "launch", "--cpu", "--num_processes", "4",
                            str(script), str(tmp_path / "b"), str(tmp_path / "b.pt"), "-"], env=_env(tmp_path),
                           capture_output=True, text=True, timeout=240)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    for a, b in zip(torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")):
        assert torch.allclose(a, b, atol=1e-6)
