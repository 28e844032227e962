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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers.replica_group_runs import (
    ROOT,
    TAG_VAR,
    kill_tagged,
    new_tag,
    processes_with,
    run_launch,
    torchft_python,
)

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
port = os.environ["MASTER_PORT"]  # the group's store: one per start of the group
log = open(os.path.join(out, f"steps_g{group}_r{rank}_p{port}_{os.getpid()}.jsonl"), "a", buffering=1)
manager = accelerator.replica_group.manager
for ids, x, y in loader:
    # What this process reads, before the step: a process its agent stops right after its group committed the
    # step (the other process failed) still shows it; the test takes the step's outcome from its group's other.
    log.write(json.dumps({"reading": ids.tolist(), "step": manager.current_step(), "padded": loader.padded}) + "\\n")
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
        FAILURE_HERE
    time.sleep(0.3)  # emulated compute: the survivor must still be training when the lost group comes back
weights = b"".join(p.detach().numpy().tobytes() for p in accelerator.unwrap_model(model).parameters())
with open(os.path.join(out, f"final_g{group}_r{rank}_{os.getpid()}.json"), "w") as f:
    json.dump({"digest": hashlib.sha256(weights).hexdigest(), "step": manager.current_step(),
               "healed": accelerator.replica_group.healed}, f)
'''


#: How the failing process fails: SIGKILL, or a hang in the script (its group's other process then waits in the
#: next quorum, and so does the other group, until the quorum times out).
FAILURES = {"kill": "os.kill(os.getpid(), signal.SIGKILL)", "hang": "time.sleep(3600)"}


def train_script(samples: int = SAMPLES, kill_rank: int = 0, failure: str = "kill") -> str:
    """The acceptance script: ``samples`` samples; in group 1, the process of rank ``kill_rank`` fails once."""
    return (TRAIN_TEMPLATE.replace("SAMPLES_HERE", str(samples)).replace("KILL_RANK_HERE", str(kill_rank))
            .replace("FAILURE_HERE", FAILURES[failure]))


TRAIN = train_script()


@dataclasses.dataclass
class KilledRun:
    """One acceptance launch: its result, its output folder and its layout."""

    proc: subprocess.CompletedProcess[str]
    out: Path
    processes: int  # over both groups
    samples: int
    failure: str  # how group 1's process failed (FAILURES)

    @property
    def per_group(self) -> int:
        return self.processes // 2


# 2 groups x 1 process (issue 38's acceptance line), and 2 groups x 2 processes where group 1's main process or
# its other process (rank 1) dies: its agent stops the group's other process at once (no graceful stop under
# replica groups), so the group leaves the Lighthouse's view within its heartbeat timeout and the survivors' next
# quorum forms without it (before, rank 0 lived on, held the survivors' quorum up until it timed out, and every
# group restarted from step 1). Last, group 1's rank 1 hangs: the quorum times out on every group; group 1 is not
# whole, so its rank 0 fails and the group leaves, while the survivors retry the quorum once and train on.
# Samples scale with the group size: the same steps.
@pytest.fixture(scope="module", params=[(2, 0, "kill"), (4, 0, "kill"), (4, 1, "kill"), (4, 1, "hang")],
                ids=["2x1", "2x2", "2x2-rank1", "2x2-rank1-hangs"])
def killed_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilledRun]:
    processes, kill_rank, failure = request.param
    samples = SAMPLES * processes // 2
    out = tmp_path_factory.mktemp("replica_groups")
    script = out / "train.py"
    script.write_text(train_script(samples, kill_rank, failure))
    proc = run_launch(out, script, "--num_processes", str(processes), "--replica_groups", "2", "--step_timeout", "5")
    yield KilledRun(proc, out, processes, samples, failure)


def _group_start(path: Path) -> str:
    """``steps_g{group}_r{rank}_p{port}_{pid}.jsonl`` -> ``g{group}_p{port}``: one start of one group."""
    _steps, group, _rank, port, _pid = path.stem.split("_")
    return f"{group}_{port}"


def _committed_batches(out: Path) -> list[dict[str, Any]]:
    """The batches of committed steps, each process's, including those of a process stopped inside a step.

    Such a process's last row is what it was reading; the step committed for its group iff another process of
    the same start of its group logged that step as committed (a group commits as a whole, and after one of its
    processes died it commits nothing more).
    """
    files = {path: [json.loads(line) for line in path.read_text().splitlines()]
             for path in sorted(out.glob("steps_*.jsonl"))}
    committed: dict[str, set[int]] = collections.defaultdict(set)  # group start -> its committed steps
    for path, rows in files.items():
        committed[_group_start(path)].update(row["step"] for row in rows if row.get("committed"))
    batches = [row for rows in files.values() for row in rows if row.get("committed")]
    for path, rows in files.items():
        last = rows[-1] if rows else {}
        if "reading" in last and last["step"] + 1 in committed[_group_start(path)]:  # rows log the step after it
            batches.append({"step": last["step"] + 1, "ids": last["reading"], "padded": last["padded"]})
    return batches


@pytest.mark.launch
def test_killed_group_is_restarted_and_the_run_exits_0(killed_run: KilledRun) -> None:
    proc, out = killed_run.proc, killed_run.out
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert (out / "killed").exists()
    assert re.search(r"replica group 1 (was killed by signal 9|exited with code \d+); restarting it", proc.stdout), \
        proc.stdout[-4000:]
    # Group 1's restart is the only one: the survivors never failed, and no group ended badly after the run
    assert proc.stdout.count("; restarting it") == 1, proc.stdout[-4000:]
    assert "finished the run; it is not restarted" not in proc.stdout, proc.stdout[-4000:]
    if killed_run.failure == "hang":  # the survivors' quorum timed out once (group 1 held it up), and was retried
        assert "replica group 0: the quorum timed out" in proc.stdout, proc.stdout[-4000:]
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
    counts = collections.Counter(i for row in _committed_batches(out) if not row["padded"] for i in row["ids"])
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

def marking(kind, write):  # the file writers of accelerator.save and save_model, marking who calls them
    def marked(*args, **kwargs):
        open(os.path.join(out, f"{kind}_g{group}_r{rank}"), "w").close()
        return write(*args, **kwargs)
    return marked

import hasten.accelerator._checkpoint as checkpoint_module
import hasten.base.serialization as serialization
serialization.save_atomically = marking("saved", serialization.save_atomically)
checkpoint_module.write_model_files = marking("model", checkpoint_module.write_model_files)

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
            accelerator.save({"digest": saved}, os.path.join(out, "obj.pt"))  # so do these two
            accelerator.save_model(model, os.path.join(out, "model"))

train_epoch()
trained = digest()
accelerator.load_state(os.path.join(out, "ckpt"))
loaded = digest()
train_epoch()  # from the saved position: the epoch's steps after the save, again
with open(os.path.join(out, f"final_g{group}_r{rank}.json"), "w") as f:
    json.dump({"saved": saved, "trained": trained, "loaded": loaded, "resumed": digest(), "folder": str(folder)}, f)
'''


@pytest.mark.launch
def test_saves_from_every_group_write_once_and_every_group_loads(tmp_path: Path) -> None:
    """save_state, save and save_model, called on every process of every group: one group writes each."""
    script = tmp_path / "save.py"
    script.write_text(SAVE)
    proc = run_launch(tmp_path, script, "--num_processes", "2", "--replica_groups", "2", "--step_timeout", "5")
    assert proc.returncode == 0, proc.stdout[-4000:]
    writers = sorted(path.name for path in tmp_path.glob("wrote_*"))
    assert writers == ["wrote_g0_r0"], writers  # one group wrote (the lowest replica id), the other skipped
    writers = sorted(path.name for path in (*tmp_path.glob("saved_*"), *tmp_path.glob("model_*")))
    assert writers == ["model_g0_r0", "saved_g0_r0"], writers  # accelerator.save and save_model: the same rule
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
    import torch

    assert torch.load(tmp_path / "obj.pt") == {"digest": finals[0]["saved"]}
    weights = load_file(str(tmp_path / "model" / "model.safetensors"))
    on_disk = b"".join(weights[name].numpy().tobytes() for name in ("weight", "bias"))
    assert hashlib.sha256(on_disk).hexdigest() == finals[0]["saved"]


@pytest.mark.launch
def test_groups_of_two_processes_that_start_apart_end_as_one_replica(tmp_path: Path) -> None:
    """Both groups (of 2 processes, from different initial weights) in the first quorum: torchft heals group rank
    0 and group rank 1 from different groups there, and hasten then aligns each group on its rank 0."""
    script = tmp_path / "train.py"
    both_groups = ('import dataclasses\nfrom hasten.fault_tolerance import FaultToleranceConfig\n'
                   'config = FaultToleranceConfig.from_json(os.environ["HASTEN_FAULT_TOLERANCE"])\n'
                   'accelerator = Accelerator(cpu=True, fault_tolerance=dataclasses.replace(config, min_replicas=2))')
    script.write_text(train_script(64).replace('group == "1"', "False")
                      .replace("accelerator = Accelerator(cpu=True)", both_groups))
    proc = run_launch(tmp_path, script, "--num_processes", "4", "--replica_groups", "2", "--step_timeout", "5")
    assert proc.returncode == 0, proc.stdout[-4000:]
    finals = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("final_*.json"))]
    assert len(finals) == 4, proc.stdout[-4000:]
    assert len({final["digest"] for final in finals}) == 1, finals
    assert {final["step"] for final in finals} == {4}  # 64 samples, 16 per step: every step with both groups


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
    tag = new_tag()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "FT_OUT": str(tmp_path), TAG_VAR: tag}
    proc = subprocess.Popen([torchft_python(), "-m", "hasten.commands.main", "launch", "--cpu", "--num_processes",
                             "2", "--replica_groups", "2", "--step_timeout", "5", str(script)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # the groups' torchft logs: wait until both groups committed a step
            if "should_commit completed should_commit=true" in line and "hasten_1" in line:
                break
        started = processes_with(tag)
        assert len(started) >= 5  # launcher, Lighthouse, 2 group agents, their workers
        proc.send_signal(signal.SIGTERM)  # to the launcher alone, not its process group
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
        assert "every replica group was stopped" in output
        assert [pid for pid in started if os.path.exists(f"/proc/{pid}") and _alive(pid)] == []
    finally:
        kill_tagged(tag, [proc])


def _alive(pid: int) -> bool:
    """False for a zombie (exited, not yet reaped by a parent outside this test)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
