"""A script whose last statement is ``save_state(..., async_save=True)`` loses nothing (issue 33, item 1).

Each script saves a first checkpoint of step 1 (every weight 1.0, a registered counter at 1), sets
step 2 and ends with an asynchronous save of it, by falling off its end, by ``sys.exit`` or by an
uncaught exception. A stage hook holds the background save until hasten's exit notice was printed, so
the save is in flight when the script ends (without the hold a small save can finish first). Ground
truth: the checkpoint that loads holds one save, of step 2 when the exit succeeded; a failing save
makes every process print its error and exit non-zero, and step 1 stays. ``kill -9`` during the exit
wait leaves a complete checkpoint of step 1 or 2 (the helpers of ``test_async_save_kill`` load it).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from hasten import Accelerator
from hasten.checkpointing import SAVE_STAGE_HOOKS
from helpers.checkpoints import newest_checkpoint_step

NOTICE = "to be published before exiting"
FAILURE = "No space left on device"
SEED = 33

SCRIPT = textwrap.dedent("""
    import sys, threading
    import torch
    from torch import nn
    from hasten import Accelerator, ProjectConfiguration
    from hasten.checkpointing import SAVE_STAGE_HOOKS

    project, ending, mode = sys.argv[1:4]   # mode: "publish", "fail", or a stage to pause at (for kill -9)

    class NoticeWatch:                          # stderr that sees hasten's exit notice go by
        def __init__(self, stream):
            self.stream, self.seen = stream, threading.Event()
        def write(self, text):
            if "to be published before exiting" in text:
                self.seen.set()
            return self.stream.write(text)
        def __getattr__(self, name):
            return getattr(self.stream, name)

    class Counter:
        def __init__(self): self.step = 0
        def state_dict(self): return {"step": self.step}
        def load_state_dict(self, state): self.step = state["step"]

    sys.stderr = watch = NoticeWatch(sys.stderr)
    accelerator = Accelerator(project_config=ProjectConfiguration(
        project_dir=project, automatic_checkpoint_naming=True, total_limit=1))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)

    def set_step(step):
        counter.step = step
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(step))

    def hold(stage, path):
        if threading.current_thread().name != "hasten-async-save":
            return
        if stage == "async_written" and accelerator.is_main_process:
            watch.seen.wait(timeout=20)         # in flight until the script has ended (the other ranks
                                                # cannot publish before this one agrees)
        last_rank_file = f"random_states_{accelerator.num_processes - 1}.pkl"
        if mode == "fail" and stage == "async_written" and path.name == last_rank_file:
            raise OSError(28, "No space left on device", str(path))
        if stage == mode and watch.seen.is_set():
            print("PAUSED", stage, flush=True)
            sys.stdin.readline()                # until killed

    set_step(1)
    accelerator.save_state()                    # checkpoint_0: the previous checkpoint
    set_step(2)
    SAVE_STAGE_HOOKS.append(hold)
    accelerator.save_state(async_save=True)     # checkpoint_1, the script's last statement ...
    if ending == "exit":
        sys.exit(0)
    if ending == "raise":
        raise RuntimeError("the training loop failed")
""")


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    env.pop("HASTEN_LAUNCH_CONFIG", None)
    return env


def _command(tmp_path: Path, ending: str, mode: str, launch: bool) -> tuple[list[str], Path]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    project = tmp_path / "project"
    prefix = [sys.executable, "-m", "hasten.commands.main", "launch", "--cpu", "--num_processes", "2"] if launch \
        else [sys.executable]
    return [*prefix, str(script), str(project), ending, mode], project


def _run(tmp_path: Path, ending: str, mode: str = "publish", launch: bool = False) -> tuple[int, str, Path]:
    command, project = _command(tmp_path, ending, mode, launch)
    proc = subprocess.run(command, env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=240)
    return proc.returncode, proc.stdout + proc.stderr, project


@pytest.mark.parametrize("ending", ["return", "exit", "raise"])
def test_python_script_ending_with_an_async_save_publishes_it(tmp_path, ending):
    code, out, project = _run(tmp_path, ending)
    assert code == (1 if ending == "raise" else 0), out
    assert out.count(NOTICE) == 1, out
    assert ending != "raise" or "RuntimeError: the training loop failed" in out
    assert newest_checkpoint_step(project, out[-3000:]) == 2  # the async save, complete and published
    assert sorted(p.name for p in (project / "checkpoints").iterdir()) == ["checkpoint_1"]  # pruned to 1


@pytest.mark.launch
def test_hasten_launch_script_ending_with_an_async_save_publishes_it(tmp_path, recwarn):
    code, out, project = _run(tmp_path, "return", launch=True)
    assert code == 0, out
    assert out.count(NOTICE) == 1, out  # the main process says it waits
    assert newest_checkpoint_step(project, out[-3000:]) == 2  # saved by 2 processes, loaded by this one


@pytest.mark.parametrize("launch", [False, pytest.param(True, marks=pytest.mark.launch)],
                         ids=["python", "hasten-launch"])
def test_a_failing_async_save_at_exit_fails_the_run_on_every_process(tmp_path, launch, recwarn):
    code, out, project = _run(tmp_path, "return", "fail", launch=launch)
    assert code != 0, out
    errors = [line for line in out.splitlines()
              if line.startswith("hasten: The background save of") and FAILURE in line]
    assert len(errors) == (2 if launch else 1), out  # printed by every process, the same message
    assert len(set(errors)) == 1 and "nothing was published; the previous checkpoint is intact" in errors[0]
    assert newest_checkpoint_step(project, out[-3000:]) == 1  # the previous checkpoint


def _kill_during_exit(tmp_path: Path, stage: str, delay: float) -> str:
    """Run the script, SIGKILL it in its exit wait (paused at ``stage``, or ``delay`` s after the notice)."""
    command, _ = _command(tmp_path, "return", stage, launch=False)
    proc = subprocess.Popen(command, env=_env(), cwd=tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        if stage == "none":
            while NOTICE not in (line := proc.stderr.readline()):
                assert line, "the script ended without the exit notice"
            time.sleep(delay)  # the random point of this trial
        else:
            assert proc.stdout.readline().strip() == f"PAUSED {stage}", proc.stderr.read()
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate(timeout=60)
    return f"killed at {stage} {delay:.3f} s after the exit notice"


@pytest.mark.parametrize(("stage", "published"), [("async_written", False), ("before_publish", False),
                                                   ("pruning", True), ("none", None)])
def test_kill_9_during_the_exit_wait_leaves_a_complete_checkpoint(tmp_path, stage, published):
    delay = random.Random(SEED).uniform(0, 0.3) if stage == "none" else 0.0
    trial = _kill_during_exit(tmp_path, stage, delay)
    step = newest_checkpoint_step(tmp_path / "project", trial)  # whatever is newest is one whole save and loads
    assert step == {False: 1, True: 2, None: step}[published], trial


class _StderrWatch:
    """``sys.stderr`` that records what goes by and sees ``phrase`` (hasten's notice) go by."""

    def __init__(self, stream, phrase: str) -> None:
        self.stream, self.phrase, self.seen, self.text = stream, phrase, threading.Event(), []

    def write(self, text: str) -> int:
        self.text.append(text)
        if self.phrase in text:
            self.seen.set()
        return self.stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def _save_held_until(watch: _StderrWatch, folder: Path, hold: bool = True) -> tuple[Accelerator, nn.Module]:
    """An async save into ``folder`` whose background thread waits (on this process) for ``watch``'s phrase.

    With several processes no model is prepared (DDP's first use imports torch._dynamo: seconds per rank).
    """
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    if accelerator.num_processes == 1:
        model = accelerator.prepare(model)

    def held(stage: str, path: Path) -> None:
        if hold and stage == "async_written" and threading.current_thread().name == "hasten-async-save":
            watch.seen.wait(timeout=20)

    SAVE_STAGE_HOOKS.append(held)
    accelerator.save_state(folder, async_save=True)
    return accelerator, model


def test_end_training_says_it_waits_for_the_save_in_flight(tmp_path, monkeypatch):
    watch = _StderrWatch(sys.stderr, "before training ends")
    monkeypatch.setattr(sys, "stderr", watch)
    try:
        accelerator, model = _save_held_until(watch, tmp_path / "ck")
        accelerator.end_training()
    finally:
        SAVE_STAGE_HOOKS.clear()
    assert "".join(watch.text).count("hasten: waiting for the asynchronous save of") == 1
    fresh = Accelerator()
    loaded = fresh.prepare(nn.Linear(64, 64))
    fresh.load_state(tmp_path / "ck")
    assert torch.equal(loaded.weight, model.weight)


def _end_group_with_a_save_in_flight(root: str) -> bool:
    from hasten.runtime.process_group import end_group

    watch = _StderrWatch(sys.stderr, "before the process group ends")
    sys.stderr = watch
    try:
        accelerator, _ = _save_held_until(watch, Path(root) / "ck", hold=Accelerator().is_main_process)
        end_group()  # as a launcher's teardown or destroy_process_group: the save needs the group to agree
    finally:
        SAVE_STAGE_HOOKS.clear()
        sys.stderr = watch.stream
    return (Path(root) / "ck" / "hasten_checkpoint.json").is_file() and not (Path(root) / "ck.tmp").exists()


@pytest.mark.world_size(2)
def test_ending_the_process_group_finishes_the_save_in_flight_first(tmp_path):
    assert _end_group_with_a_save_in_flight(str(tmp_path))
