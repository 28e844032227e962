"""A real SLURM cluster: slurmctld + one slurmd per network namespace (2 nodes) + munge, from OS packages.

A 2-node job runs the training script both ways Accelerate documents: every ``srun`` task is one process
(detected by hasten from ``SLURM_*``), and one ``hasten launch`` per node. An ``sbatch --requeue`` job
signalled mid-training checkpoints, requeues itself, is started again by SLURM and resumes exactly.
Needs root, iproute2 and the SLURM packages (``.ci/run`` installs them on CI machines); skipped with the
reason otherwise.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import hasten.testing
from hasten.testing import run_on_ranks
from hasten.testing.netns import netns_unavailable, simulated_machines
from hasten.testing.slurm_cluster import slurm_cluster, slurm_unavailable

# serial: wall-clock bounds and cluster daemons; `make test` runs these alone, after the parallel part
pytestmark = [pytest.mark.launch, pytest.mark.serial]
_WHY_NOT = netns_unavailable() or slurm_unavailable()
SCRIPTS = Path(hasten.testing.__file__).parent / "scripts"
TRAIN = str(SCRIPTS / "regression_train.py")
PREEMPTIBLE = SCRIPTS / "preemption_train.py"
_NS: dict = {"__name__": "preemption_train"}
exec(compile(PREEMPTIBLE.read_text(), str(PREEMPTIBLE), "exec"), _NS)  # its train(), for the uninterrupted run

# Node names do not resolve on this simulated cluster (as on clusters without DNS for compute nodes): the
# job takes the first node's address from SLURM itself.
MASTER = """first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
export MASTER_ADDR=$(scontrol show node "$first" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')
"""
JOBS = {
    "srun-tasks": ("--ntasks-per-node=2", f"srun {sys.executable} {TRAIN} {{out}} 12 {{crash}}"),
    "launch-per-node": ("--ntasks-per-node=1 --cpus-per-task=2",
                        f"srun {sys.executable} -m hasten.commands.main launch --cpu --num_processes 4 {TRAIN} "
                        "{out} 12 {crash}"),
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if _WHY_NOT:
        pytest.skip(f"SLURM cluster unavailable: {_WHY_NOT}")
    with simulated_machines(2, tag=f"hs{os.getpid() % 100000}") as machines:
        with slurm_cluster(machines, tmp_path_factory.mktemp("slurm")) as running:
            yield running


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    done = subprocess.run([sys.executable, TRAIN, str(out), "12", "-1"], env=_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads((out / "rank0.json").read_text())["weights"]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("GLOO_SOCKET_IFNAME", None)
    return env


def _job(cluster, tmp_path, layout, crash=-1):
    options, command = JOBS[layout]
    out = tmp_path / "out"
    out.mkdir()
    job = tmp_path / "job.sh"
    job.write_text(f"#!/bin/bash\nset -e\ncd {tmp_path}\n{MASTER}{command.format(out=out, crash=crash)}\n")
    # salloc runs the job script in a 2-node allocation and returns when it ends: the same job as
    # `sbatch`, without `sbatch --wait`'s polling (which added ~30 s per job).
    argv = ["salloc", "-N2", *options.split(), "bash", str(job)]
    done = subprocess.run(cluster.on_node(0, argv), env=cluster.env(_env()), capture_output=True, text=True,
                          timeout=180)
    return done.returncode, done.stdout + done.stderr, out


@pytest.mark.parametrize("layout", sorted(JOBS))
def test_two_node_slurm_job_trains_like_one_process(cluster, reference, tmp_path, layout):
    code, log, out = _job(cluster, tmp_path, layout)
    assert code == 0, log
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    assert {r["host"] for r in results} == {"node0", "node1"}  # really spread over the two nodes
    assert all(r["world"] == 4 and r["master"] == cluster.machines[0].ip for r in results)
    for r in results:
        assert r["weights"] == pytest.approx(reference, abs=1e-5)


def test_a_crash_in_a_slurm_job_stops_every_node(cluster, tmp_path):
    # srun itself (a job of one step) returns when the last task ended; `sbatch --wait` would add its polling.
    out = tmp_path / "out"
    out.mkdir()
    argv = ["srun", "-N2", "--ntasks-per-node=2", sys.executable, TRAIN, str(out), "12", "3"]
    env = cluster.env({**_env(), "MASTER_ADDR": cluster.machines[0].ip})
    done = subprocess.run(cluster.on_node(0, argv), env=env, capture_output=True, text=True, timeout=180)
    ended = time.time()
    log = done.stdout + done.stderr
    assert done.returncode != 0, log
    assert "RuntimeError: rank 3 fails on purpose" in log, log
    assert all(f"task {t}: Exited with exit code" in log for t in range(4)), log  # every task stopped
    crash_at = float(log.split("crash-at ")[1].split()[0])
    print(f"SLURM job: failure-to-stop across nodes {ended - crash_at:.1f} s")


def _wait_for(what, ready, timeout, log):
    """Poll ``ready()`` (a condition, not a delay) until it is true; fail with ``what`` and the log after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout} s\n{log()}")
        time.sleep(0.05)


def test_a_preempted_batch_job_requeues_itself_and_resumes_exactly(cluster, tmp_path):
    # An `sbatch --requeue` job whose 2 SLURM tasks are one process each (`srun hasten launch --preemption_signal
    # USR1`; the docs' one agent per node would add a third torch process to each run). Its first run marks the
    # moment to signal; SLURM starts the requeued job again with SLURM_RESTART_COUNT=1, and that run resumes.
    project, mark, log = tmp_path / "project", tmp_path / "mark", tmp_path / "job.log"
    launch = (f"{sys.executable} -m hasten.commands.main launch --cpu --preemption_signal USR1 {PREEMPTIBLE} "
              f"{project} {tmp_path}/run$SLURM_RESTART_COUNT.pt")
    job = tmp_path / "job.sh"
    job.write_text(f"""#!/bin/bash
cd {tmp_path}
{MASTER}export SLURM_RESTART_COUNT=${{SLURM_RESTART_COUNT:-0}}  # SLURM sets it from the first requeue on
[ "$SLURM_RESTART_COUNT" = 0 ] && marker={mark}
srun {launch} $marker
echo "run $SLURM_RESTART_COUNT exit $?" > {tmp_path}/ended$SLURM_RESTART_COUNT
""")
    env = cluster.env(_env())
    argv = ["sbatch", "--parsable", "--requeue", "--open-mode=append", f"--output={log}", "-N1", "--ntasks=2",
            str(job)]
    submitted = subprocess.run(cluster.on_node(0, argv), env=env, capture_output=True, text=True, timeout=30)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    ended = [tmp_path / "ended0", tmp_path / "ended1"]  # the batch script's last line, per run
    times = {"submit": time.time()}

    def show():
        done = subprocess.run(cluster.on_node(0, ["scontrol", "show", "job", job_id]), env=env, capture_output=True,
                              text=True, timeout=30)
        return done.stdout + done.stderr

    def job_log():
        return (log.read_text() if log.exists() else "(no job log)") + "\n" + show()

    def logged(text):
        return log.exists() and text in log.read_text()

    try:  # the waits watch files the job writes (a first run that ends by itself writes ended0), scontrol at the end
        _wait_for("the first run's mark", lambda: mark.exists() or ended[0].exists(), 90, job_log)
        assert mark.exists(), job_log()
        times["signal"] = time.time()
        # What `--signal=USR1@N` does N s before the time limit (every task of the job's steps, not the batch
        # shell), at a moment of the test's choosing: SLURM looks at time limits only about once a minute.
        signalled = subprocess.run(cluster.on_node(0, ["scancel", "--signal=USR1", job_id]), env=env,
                                   capture_output=True, text=True, timeout=30)
        assert signalled.returncode == 0, signalled.stderr
        _wait_for("the requeue", lambda: logged(f"SLURM job {job_id} requeued") or ended[0].exists(), 60, job_log)
        assert logged(f"SLURM job {job_id} requeued"), job_log()
        times["requeued"] = time.time()
        # The uninterrupted run, while SLURM holds the requeued job back (BeginTime: cred_expire + 1 s).
        [(full, full_end), _] = run_on_ranks(_NS["train"], world_size=2,
                                             args=(str(tmp_path / "full"), None, False, True, 0))
        times["reference"] = time.time()
        _wait_for("the end of the requeued job", ended[1].exists, 90, job_log)
        _wait_for("COMPLETED", lambda: "JobState=COMPLETED" in show(), 30, job_log)  # the script just ended
        times["completed"] = time.time()
    finally:
        if "completed" not in times:
            subprocess.run(cluster.on_node(0, ["scancel", job_id]), env=env, capture_output=True, timeout=30)
    print("SLURM requeue: " + ", ".join(f"{k} +{v - times['submit']:.1f} s" for k, v in times.items()))
    text = job_log()
    assert "hasten: preempted by SIGUSR1" in text and "Restarts=1 " in text, text
    assert ended[1].read_text() == "run 1 exit 0\n", text
    assert sorted(os.listdir(project / "checkpoints")) == ["checkpoint_0"]  # exactly one: the preemption's
    rest, end = torch.load(tmp_path / "run1.pt")
    assert end[0] == "done", text
    assert 0 < len(rest) < len(full) and rest == full[-len(rest):]  # resumed mid-run, on the same samples
    assert all(torch.equal(a, b) for a, b in zip(full_end[1], end[1]))
