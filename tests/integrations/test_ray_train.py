"""Ray Train (issue 35): an unchanged hasten script inside ``ray.train.torch.TorchTrainer`` on a local Ray cluster.

One subprocess with ``HASTEN_RAY_PYTHON``'s interpreter (``make test`` builds ``.ray-venv``, layered over ``.venv``
with ``ray[train]``) starts a local Ray cluster (a 2-CPU head node and a second node that the elastic case
preempts), runs the cases of ``ray_scripts/run_trainers.py`` on the script
``ray_scripts/train.py`` and shuts Ray down; ``hasten launch --num_processes 2`` runs the same script. Ground truth:
the uninterrupted run's weights, and its samples step by step. Each worker logs the ids it trained on per
optimizer step, tagged with its attempt; the steps that count are each step's entries from the newest attempt
that reached it (the steps a killed attempt did after its last checkpoint were thrown away with it).
"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

# Ray's cluster is a set of daemons on the 2 cores; its worker groups' start-up is most of the time (about
# 3.5 minutes in all on 2 quiet cores, up to twice that on loaded ones): the fixture's test gets a longer bound.
pytestmark = [pytest.mark.launch, pytest.mark.serial, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "ray_scripts"
CASES = ("plain", "failure", "elastic")
SAMPLES, STEPS_PER_EPOCH = 32, 4
FSDP2_CONFIG = ("compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nmixed_precision: 'no'\nnum_processes: 2\n"
                "use_cpu: true\nfsdp_config:\n  fsdp_version: 2\n")


def _ray_python() -> str:
    candidate = Path(os.environ.get("HASTEN_RAY_PYTHON") or ROOT / ".ray-venv" / "bin" / "python")
    if not candidate.exists():
        pytest.fail(f"no interpreter at {candidate} ($HASTEN_RAY_PYTHON): run `make ray-venv` (`make test` builds it)")
    return str(candidate)


def _env(folder: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HASTEN_LAUNCH", "ACCELERATE_", "FSDP_", "RAY_"))}
    env.update(PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{SCRIPTS}", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               HASTEN_HOME=str(folder / "home"), TMPDIR=str(folder), RAY_AUTH_MODE="disabled",
               RAY_USAGE_STATS_ENABLED="0", RAY_TRAIN_ENABLE_PREEMPTION_WATCHER="0", **extra)
    return env


def _run(argv: list[str], folder: Path, timeout: int, **extra: str) -> str:
    """Run ``argv`` in its own session; on a timeout the whole session goes (Ray's daemons are in it)."""
    started = time.monotonic()
    process = subprocess.Popen(argv, cwd=folder, env=_env(folder, **extra), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{argv[:3]} did not finish in {timeout} s\n{output[-12000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):  # what Ray left behind after a failure
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, f"{argv[:3]} exited {process.returncode}\n{output[-12000:]}"
    print(f"{' '.join(Path(a).name for a in argv[1:4])}: {time.monotonic() - started:.1f} s")
    return output


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """The Ray cases and the ``hasten launch`` run, each in its own folder under the returned one."""
    folder = tmp_path_factory.mktemp("ray")
    (folder / "launch").mkdir()
    _run([sys.executable, "-m", "hasten.commands.main", "launch", "--num_processes", "2", str(SCRIPTS / "train.py"),
          json.dumps({"out": str(folder / "launch")})], folder, timeout=180)
    config = folder / "fsdp2.yaml"
    config.write_text(FSDP2_CONFIG)
    # Ray's sockets live in its temporary folder: a short path keeps them under the 107-byte limit.
    ray_temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    try:
        output = _run([_ray_python(), str(SCRIPTS / "run_trainers.py"), str(folder), *CASES], folder, timeout=780,
                      RAY_TEST_TEMP_DIR=ray_temp, RAY_TEST_CONFIG_FILE=str(config))
    finally:
        shutil.rmtree(ray_temp, ignore_errors=True)
    print("\n".join(line for line in output.splitlines() if line.startswith(("ray.init took", "case "))))
    return folder


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    saved = torch.load(folder / "weights.pt", weights_only=True)
    assert saved["step"] == 2 * STEPS_PER_EPOCH
    return saved["weights"]


def _entries(*folders: Path) -> list[dict]:
    return [json.loads(line) for folder in folders for log in sorted(folder.glob("samples-rank*.jsonl"))
            for line in log.read_text().splitlines()]


def _steps_that_count(entries: list[dict]) -> dict[int, list[int]]:
    """Step -> the sample ids of that step over all workers, from the newest attempt that reached the step."""
    newest: dict[int, int] = {}
    for entry in entries:
        newest[entry["step"]] = max(newest.get(entry["step"], entry["attempt"]), entry["attempt"])
    steps: dict[int, list[int]] = {}
    for entry in entries:
        if entry["attempt"] == newest[entry["step"]]:
            steps.setdefault(entry["step"], []).extend(entry["ids"])
    return steps


def _assert_each_sample_once_as_uninterrupted(steps: dict[int, list[int]], runs: Path) -> None:
    uninterrupted = _steps_that_count(_entries(runs / "plain"))
    assert sorted(steps) == list(range(1, 2 * STEPS_PER_EPOCH + 1))
    for epoch in range(2):  # every sample exactly once per epoch
        ids = [i for step in range(1 + epoch * STEPS_PER_EPOCH, 1 + (epoch + 1) * STEPS_PER_EPOCH) for i in steps[step]]
        assert sorted(ids) == list(range(SAMPLES)), f"epoch {epoch}: {sorted(ids)}"
    assert {s: sorted(i) for s, i in steps.items()} == {s: sorted(i) for s, i in uninterrupted.items()}


def _assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tolerance: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] - b[name]).abs().max().item() <= tolerance, name


def test_unchanged_script_under_torchtrainer_equals_hasten_launch_bit_for_bit(runs):
    ray_weights, launch_weights = _weights(runs / "plain"), _weights(runs / "launch")
    assert all(torch.equal(ray_weights[name], launch_weights[name]) for name in launch_weights)
    assert {e["world"] for e in _entries(runs / "plain")} == {2}  # hasten adopted Ray's two ranks


def test_worker_killed_mid_epoch_ray_restarts_and_the_run_ends_as_uninterrupted(runs):
    entries = _entries(runs / "failure")
    attempts = sorted({e["attempt"] for e in entries})
    assert len(attempts) == 2 and (runs / "failure" / "killed").exists()
    first_steps = {e["step"] for e in entries if e["attempt"] == attempts[1]}
    assert min(first_steps) == 3  # resumed from the step-2 checkpoint Ray handed back, mid-epoch
    _assert_each_sample_once_as_uninterrupted(_steps_that_count(entries), runs)
    _assert_close(_weights(runs / "failure"), _weights(runs / "plain"), 1e-6)


def test_preemption_notice_saves_at_one_step_and_the_elastic_restart_on_one_worker_ends_as_uninterrupted(runs):
    entries = _entries(runs / "elastic")
    attempts = sorted({e["attempt"] for e in entries})
    assert len(attempts) == 2
    assert {e["world"] for e in entries if e["attempt"] == attempts[0]} == {2}
    # Both workers saved on Ray's notice after step 3 (one folder, handed to Ray), and the elastic range's restart
    # on the one worker left resumed right after it: no step was done twice.
    assert (runs / "elastic" / "ray_storage" / "run" / "step_3").is_dir()
    resumed = [e for e in entries if e["attempt"] == attempts[1]]
    assert {e["world"] for e in resumed} == {1} and min(e["step"] for e in resumed) == 4
    assert sorted(e["step"] for e in entries) == [1, 1, 2, 2, 3, 3, 4, 5, 6, 7, 8]
    _assert_each_sample_once_as_uninterrupted(_steps_that_count(entries), runs)
    _assert_close(_weights(runs / "elastic"), _weights(runs / "plain"), 1e-6)


def test_config_file_is_honoured_under_ray_and_fsdp2_shards(runs):
    facts = [json.loads((runs / "failure" / f"fsdp-rank{rank}.json").read_text()) for rank in range(2)]
    for fact in facts:  # the first layer's 16 rows, half on each of the two workers
        assert fact == {"rows": 8, "distributed_type": "FSDP", "mixed_precision": "no"}
    # after the elastic shrink the one worker left reads the same file: FSDP2 over one process holds every row
    assert json.loads((runs / "elastic" / "fsdp-rank0.json").read_text())["rows"] == 16
