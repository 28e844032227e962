"""Preemption without a prepared data loader (issue 33, item 2): every step boundary is a stop point.

After optimizer step ``S`` outside a loader pass, the next forward of a prepared model, optimizer step
or Accelerator collective stops every rank; in a stretch without optimizer steps (evaluation) the ranks
agree on a collective to stop before. Forked gloo ranks for the agreement and the exact resume,
``hasten launch`` for the exit code and the time from the signal to the exit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hasten import PREEMPTED_EXIT_CODE, Accelerator, ProjectConfiguration
from hasten.runtime import preemption
from hasten.testing import run_on_ranks
from hasten.utils import set_seed

ITERATIONS = 60


class _Progress:
    """The loop's own position, saved with the checkpoint (the loop indexes plain tensors: no loader)."""

    def __init__(self) -> None:
        self.done = 0

    def state_dict(self) -> dict[str, int]:
        return {"done": self.done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.done = state["done"]


def _wait_until_learned() -> None:
    """Bounded: the tiny steps must not finish the loop before this rank's watcher learned of the signal."""
    deadline = time.monotonic() + 30
    while not preemption.PREEMPTION.pending and time.monotonic() < deadline:
        time.sleep(0.005)


def _plain_loop(project: str, kill_at: int | None, resume: bool):
    """Train on slices of one tensor (no data loader), with dropout; the last rank signals itself at ``kill_at``."""
    accelerator = Accelerator(project_config=ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True))
    set_seed(5)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.9)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    progress = _Progress()
    accelerator.register_for_checkpointing(progress)
    if resume:
        accelerator.load_state()
    x = torch.randn(ITERATIONS * 8, 6, generator=torch.Generator().manual_seed(3))
    rank, world = accelerator.process_index, accelerator.num_processes
    losses: list[float] = []
    try:
        for i in range(progress.done, ITERATIONS):
            batch = x[i * 8:(i + 1) * 8][rank::world]
            loss = nn.functional.mse_loss(model(batch), batch.sum(1, keepdim=True))
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            progress.done = i + 1
            losses.append(round(loss.item(), 7))
            if i == kill_at and rank == world - 1:
                os.kill(os.getpid(), signal.SIGTERM)
                _wait_until_learned()
    except preemption.Preempted as exc:
        return losses, ("stopped", preemption.PREEMPTION.steps, exc.code)
    return losses, ("done", [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()])


def test_a_loop_without_a_loader_saves_at_the_next_forward_and_resumes_exactly(tmp_path):
    full = run_on_ranks(_plain_loop, world_size=2, args=(str(tmp_path / "full"), None, False))
    stopped = run_on_ranks(_plain_loop, world_size=2, args=(str(tmp_path / "run"), 5, False))
    ends = [end for _, end in stopped]
    assert all(end[0] == "stopped" and end[2] == PREEMPTED_EXIT_CODE for end in ends), ends
    assert len({end[1] for end in ends}) == 1 and 6 <= ends[0][1] < ITERATIONS, ends  # one common step S
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["checkpoint_0"]
    resumed = run_on_ranks(_plain_loop, world_size=2, args=(str(tmp_path / "run"), None, True))
    for (full_losses, full_end), (first, _), (rest, end) in zip(full, stopped, resumed):
        assert len(first) == ends[0][1]  # stopped before the forward that follows step S
        assert first + rest == full_losses  # the same batches, the same dropout, the same results
        assert end[0] == "done" and all(torch.equal(a, b) for a, b in zip(full_end[1], end[1]))


def _loader_loop_with_a_gather():
    """A prepared loader and a collective after every step: the loader's next batch stays the boundary."""
    accelerator = Accelerator()
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(400, 4, generator=torch.Generator().manual_seed(2))), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    gathered = 0
    try:
        for index, (x,) in enumerate(loader):
            accelerator.backward(model(x).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
            accelerator.gather(x)
            gathered += 1
            if index == 2:
                os.kill(os.getpid(), signal.SIGTERM)
                _wait_until_learned()
    except preemption.Preempted as exc:
        return exc.code, preemption.PREEMPTION.steps, gathered
    return "the loop ran to its end"


def test_with_a_prepared_loader_the_collective_after_step_s_is_not_the_boundary():
    # Signalled after step 3: S = 4, and the gather that follows step 4 still runs before the next batch stops it.
    assert run_on_ranks(_loader_loop_with_a_gather, world_size=1) == [(PREEMPTED_EXIT_CODE, 4, 4)]


def _evaluation(kill_at: int, polls: bool):
    """A few training steps, then evaluation (no steps, one gather_for_metrics per batch); rank 1 is signalled."""
    preemption.NO_STEP_SECONDS = 0.3  # this forked rank only: the suite need not wait the real 5 s
    accelerator = Accelerator()
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        accelerator.backward(model(x).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    seen = None
    try:
        for i in range(100_000):  # ends only by preemption
            with torch.no_grad():
                accelerator.gather_for_metrics(model(x))
            if i == kill_at and accelerator.process_index == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            if polls and accelerator.preemption_requested:
                seen = i
                break
    except preemption.Preempted as exc:
        return "exited", exc.code, preemption.PREEMPTION.calls
    return "requested", seen, preemption.PREEMPTION.calls


def test_evaluation_without_steps_stops_every_rank_before_the_same_collective():
    ends = run_on_ranks(_evaluation, world_size=2, args=(3, False))
    assert all(end[:2] == ("exited", PREEMPTED_EXIT_CODE) for end in ends), ends
    assert ends[0][2] == ends[1][2] > 4, ends  # the same gather_for_metrics call, after the signal


def test_evaluation_that_polls_the_flag_sees_it_at_the_same_batch_on_every_rank():
    ends = run_on_ranks(_evaluation, world_size=2, args=(3, True))
    assert all(end[0] == "requested" for end in ends) and ends[0][1:] == ends[1][1:] and ends[0][1] > 3, ends


def _evaluate_a_loader(project: str, kill_at: int | None, resume: bool):
    """Evaluation over a prepared loader with automatic naming; returns the sample ids gathered and how it ended."""
    preemption.NO_STEP_SECONDS, preemption.POLL_SECONDS = 0.2, 0.05  # this forked rank only
    accelerator = Accelerator(project_config=ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True))
    model = nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.arange(2_000.0).unsqueeze(1)), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if resume:
        accelerator.load_state()
    seen: list[float] = []
    try:
        for index, (x,) in enumerate(loader):
            with torch.no_grad():
                model(x)
            seen += accelerator.gather_for_metrics(x).flatten().tolist()
            if index == kill_at and accelerator.process_index == 1:
                os.kill(os.getpid(), signal.SIGTERM)
    except preemption.Preempted as exc:
        return seen, ("stopped", exc.code, preemption.PREEMPTION.calls)
    return seen, ("done",)


def test_evaluation_over_a_loader_saves_its_position_and_the_resume_sees_the_rest(tmp_path):
    stopped = run_on_ranks(_evaluate_a_loader, world_size=2, args=(str(tmp_path), 3, False))
    assert all(end[:2] == ("stopped", PREEMPTED_EXIT_CODE) for _, end in stopped), [end for _, end in stopped]
    assert stopped[0] == stopped[1]  # the same samples seen, the same collective count at the stop
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_0"]
    resumed = run_on_ranks(_evaluate_a_loader, world_size=2, args=(str(tmp_path), None, True))
    first, rest = stopped[0][0], resumed[0][0]
    assert len(first) < 2_000 and first + rest == [float(i) for i in range(2_000)]  # every sample exactly once


# Run by `hasten launch`: "train" steps on plain tensors (no loader), "evaluate" gathers without steps. Neither has
# automatic checkpoint naming or reads `preemption_requested`. Rank 0 creates MARKER, then waits (bounded) until its
# watcher learned of the signal that the test sends on seeing the file.
_SCRIPT = """
import sys, time
import torch
from hasten import Accelerator
from hasten.runtime.preemption import PREEMPTION

mode, marker = sys.argv[1], sys.argv[2]
accelerator = Accelerator()
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
model, optimizer = accelerator.prepare(model, optimizer)
x = torch.randn(16, 8)
for i in range(10**7):
    if mode == "train" or i < 2:
        accelerator.backward(model(x).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    else:
        with torch.no_grad():
            accelerator.gather_for_metrics(model(x))
    if i == 4 and accelerator.is_main_process:
        open(marker, "w").close()
        deadline = time.monotonic() + 60
        while not PREEMPTION.pending and time.monotonic() < deadline:
            time.sleep(0.01)
print("the loop ran to its end")
"""


@pytest.mark.launch
@pytest.mark.serial  # asserts a bound on the time from the signal to the exit
@pytest.mark.parametrize("mode", ["train", "evaluate"])
def test_sigterm_without_a_loader_or_steps_exits_75_well_inside_the_grace_period(tmp_path, mode):
    script, marker = tmp_path / "loop.py", tmp_path / "mark"
    script.write_text(_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", HASTEN_HOME=str(tmp_path / "home"))
    env.pop("HASTEN_LAUNCH_CONFIG", None)
    proc = subprocess.Popen([sys.executable, "-m", "hasten.commands.main", "launch", "--cpu", "--num_processes", "2",
                             "--preemption_grace", "30", str(script), mode, str(marker)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # waiting for the file (no fixed delay: the workers wait for the signal)
        assert marker.exists(), proc.communicate(timeout=30)[0]
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == PREEMPTED_EXIT_CODE, out
    assert took < 15, f"{took:.1f} s from SIGTERM to the exit (the grace period is 30 s)\n{out}"
    assert out.count("no checkpoint was written") == 1, out  # one line, from rank 0
    assert "every worker stopped after optimizer step" in out and "without a checkpoint" in out, out
    assert "the loop ran to its end" not in out
