"""``kill -9`` at random points of asynchronous saves always leaves a loadable previous checkpoint (issue 24, item 4).

Two processes save asynchronously back to back (each ``save_state(async_save=True)`` waits for the one
before, so at any instant some save is being snapshotted, written, fsynced, agreed on, published or
pruned). A trial kills one of them with SIGKILL after a random delay drawn from a seeded generator
(``SEED``: a failure names its trial and is replayed by rerunning), then the rest of the group, as a
launcher's agent does. Ground truth: the newest complete checkpoint loads, and its files are of one
save (the weights equal the step its registered counter holds). The next trial resumes from it, as an
elastic restart would, so the leftovers of every killed save meet the next one.

18 trials fork the two ranks from this process (a restart costs a fork, not an interpreter); 2 go
through ``hasten launch`` itself: one rank killed (its agent restarts the group, which resumes from the
checkpoint) and then the launcher killed (its workers die with it).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from hasten.testing.distributed import _rank_main
from helpers.checkpoints import newest_checkpoint_step

SEED = 24
FORKED_TRIALS = 18
MAX_DELAY_S = 0.4  # longer than one save of this model on a loaded machine: the kill lands anywhere in it

WORKER = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    import torch
    from torch import nn
    from hasten import Accelerator, ProjectConfiguration
    from hasten.checkpointing import newest_checkpoint

    class Counter:
        def __init__(self): self.step = 0
        def state_dict(self): return {"step": self.step}
        def load_state_dict(self, state): self.step = state["step"]

    def save_forever(project, markers):
        accelerator = Accelerator(project_config=ProjectConfiguration(
            project_dir=project, automatic_checkpoint_naming=True, total_limit=2))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))  # 2 MB of weights, 6 MB with AdamW
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = accelerator.prepare(model, optimizer)
        counter = Counter()
        accelerator.register_for_checkpointing(counter)
        if newest_checkpoint(project) is None:
            accelerator.save_state()                      # the first trial's previous checkpoint
        else:
            accelerator.load_state()                      # a restart: must load, and be of one save
            weights = accelerator.unwrap_model(model)[0].weight
            if not torch.equal(weights, torch.full_like(weights, float(counter.step))):
                raise RuntimeError(f"checkpoint of step {counter.step} holds other weights")
        first = True
        while True:
            counter.step += 1
            accelerator.backward(model(torch.ones(2, 512)).sum())
            optimizer.step()
            optimizer.zero_grad()
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float(counter.step))
            accelerator.save_state(async_save=True)
            if first:                                     # in the save loop: the test may kill from now on
                first = False
                Path(markers, f"{accelerator.process_index}.{os.getpid()}").touch()

    if __name__ == "__main__":
        save_forever(sys.argv[1], sys.argv[2])
""")


def _worker() -> dict:
    namespace: dict = {"__name__": "worker"}
    exec(compile(WORKER, "worker", "exec"), namespace)
    return namespace


def _wait_for_markers(markers: Path, count: int, alive: Callable[[], bool], deadline: float) -> dict[int, int]:
    """``{rank: pid}`` once ``count`` ranks are in their save loop (polled; bounded by ``deadline``)."""
    while True:
        found = {int(p.name.split(".")[0]): int(p.name.split(".")[1]) for p in markers.iterdir()}
        if len(found) == count:
            return found
        errors = "".join(p.read_text()[-1500:] for p in markers.parent.glob(f"ranks{markers.name[7:]}/*.err"))
        assert alive(), f"the ranks ended before they reached their save loop {errors}"
        assert time.monotonic() < deadline, "the ranks did not reach their save loop in time"
        time.sleep(0.02)


def _dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return True


@pytest.mark.launch
def test_kill_9_at_random_points_of_async_saves_keeps_a_loadable_checkpoint(tmp_path, recwarn):
    rng = random.Random(SEED)
    project = tmp_path / "project"
    steps = []
    save_forever = _worker()["save_forever"]
    for trial in range(FORKED_TRIALS):
        markers = tmp_path / f"markers{trial}"
        markers.mkdir()
        ranks = tmp_path / f"ranks{trial}"
        ranks.mkdir()
        context = mp.start_processes(_rank_main, args=(2, str(ranks), save_forever, (str(project), str(markers)),
                                                       30.0, {}), nprocs=2, join=False, start_method="fork")
        try:
            pids = _wait_for_markers(markers, 2, lambda ps=context.processes: all(p.is_alive() for p in ps),
                                     time.monotonic() + 60)
            victim, delay = rng.randrange(2), rng.uniform(0, MAX_DELAY_S)
            time.sleep(delay)  # the random point of this trial
            os.kill(pids[victim], signal.SIGKILL)
        finally:
            for process in context.processes:  # the rest of the group goes down with it
                process.kill()
                process.join(timeout=30)
        steps.append(newest_checkpoint_step(project, f"trial {trial} (seed {SEED}, rank {victim} killed after {delay:.3f} s)"))
    assert steps == sorted(steps) and steps[-1] > steps[0]  # the trials resumed and went on saving

    # Through the launcher: a rank killed (the agent restarts the group from the checkpoint), then the launcher.
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    markers = tmp_path / "markers-launch"
    markers.mkdir()
    launcher = subprocess.Popen([sys.executable, "-m", "hasten.commands.main", "launch", "--cpu", "--num_processes",
                                 "2", "--max_restarts", "1", str(script), str(project), str(markers)],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    workers: dict[int, int] = {}
    try:
        alive = lambda: launcher.poll() is None  # noqa: E731
        workers = _wait_for_markers(markers, 2, alive, time.monotonic() + 120)
        victim, delay = rng.randrange(2), rng.uniform(0, MAX_DELAY_S)
        time.sleep(delay)
        for marker in list(markers.iterdir()):
            marker.unlink()
        os.kill(workers[victim], signal.SIGKILL)
        workers = _wait_for_markers(markers, 2, alive, time.monotonic() + 120)  # restarted, loaded, saving
        delay = rng.uniform(0, MAX_DELAY_S)
        time.sleep(delay)
        os.kill(launcher.pid, signal.SIGKILL)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        stderr = launcher.communicate(timeout=60)[1]
        deadline = time.monotonic() + 30
        while not all(_dead(pid) for pid in workers.values()):  # they die with their launcher
            assert time.monotonic() < deadline, f"workers outlived their launcher: {stderr[-2000:]}"
            time.sleep(0.05)
    assert launcher.returncode == -signal.SIGKILL, stderr[-2000:]
    final = newest_checkpoint_step(project, f"launcher killed after {delay:.3f} s (seed {SEED})")
    assert final >= steps[-1]
