"""Graceful preemption (issue 25, item 1): a signal to one rank stops every rank at the same optimizer step.

Forked gloo ranks (``run_on_ranks``); the signal is sent by one rank to itself mid-training. The watcher
polls the store every 20 ms here (1 s in a real run) so that the tiny steps do not outrun it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import hasten.testing
from hasten import PREEMPTED_EXIT_CODE
from hasten.runtime import preemption
from hasten.testing import run_on_ranks

SIGNAL_AT = 9  # the signal arrives inside the 9th micro-batch of the signalled rank

# The training script, run by forked ranks (its functions, exec'd here) and by `hasten launch` (as a file).
SCRIPT_PATH = Path(hasten.testing.__file__).parent / "scripts" / "preemption_train.py"
SCRIPT = SCRIPT_PATH.read_text()
_NS: dict = {}
exec(compile(SCRIPT, "preemption_script", "exec"), _NS)  # noqa: S102 - the test's own script
_train = _NS["train"]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """The uninterrupted run on 2 forked ranks: every test compares with it."""
    return run_on_ranks(_train, world_size=2, args=(str(tmp_path_factory.mktemp("full")), None, False, True, 0))


def _stop_and_resume(tmp_path, full, world_size, auto, sig=signal.SIGTERM, env=None):
    how = ("kill", world_size - 1, sig)
    stopped = run_on_ranks(_train, world_size=world_size, args=(str(tmp_path), how, False, auto, SIGNAL_AT), env=env)
    ends = [end for _, end in stopped]
    assert all(end[0] == "stopped" for end in ends), ends
    assert len({(end[1], end[2]) for end in ends}) == 1, f"ranks stopped at different steps: {ends}"
    stop_step, steps = ends[0][1], ends[0][2]
    assert steps == stop_step >= SIGNAL_AT // 2  # right after optimizer step S, never before the signal
    assert all(end[3] == (PREEMPTED_EXIT_CODE if auto else None) for end in ends)
    if auto:
        assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_0"]
    resumed = run_on_ranks(_train, world_size=world_size, args=(str(tmp_path), None, True, auto, 0))
    for (full_losses, full_end), (first, _), (rest, end) in zip(full, stopped, resumed):
        assert len(first) == 2 * stop_step  # accumulation 2: S optimizer steps are 2 S micro-batches
        assert first + rest == full_losses  # the same samples, in the same order, with the same results
        assert end[0] == "done" and all(torch.equal(a, b) for a, b in zip(full_end[1], end[1]))


def test_signal_to_one_rank_stops_all_at_one_step_saves_and_resumes_exactly(tmp_path, full_run):
    # Inside a SLURM job, one process requeues it once the checkpoint is published (a stand-in scontrol).
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f"#!/bin/sh\n[ \"$1\" = show ] && echo 'JobId=42 Requeue=1 Restarts=0' && exit 0\n"
                        f"ls {tmp_path / 'run' / 'checkpoints'} >> {tmp_path / 'requeued'}; echo \"$@\" >> "
                        f"{tmp_path / 'requeued'}\n")
    scontrol.chmod(0o755)
    env = {"SLURM_JOB_ID": "42", "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    _stop_and_resume(tmp_path / "run", full_run, 2, auto=True, env=env)
    assert (tmp_path / "requeued").read_text().split("\n") == ["checkpoint_0", "requeue 42", ""]


def test_one_process_stops_after_the_next_step_and_saves(tmp_path):
    # No store: the watcher decides alone (S = its step count + 1). The resume is the 2-rank tests' business.
    [(losses, end)] = run_on_ranks(_train, world_size=1, args=(str(tmp_path), ("kill", 0, signal.SIGTERM), False, True,
                                                                 SIGNAL_AT))
    assert end[0] == "stopped" and end[1] == end[2] >= SIGNAL_AT // 2 and end[3] == PREEMPTED_EXIT_CODE
    assert len(losses) == 2 * end[1] and sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_0"]


def test_without_a_project_folder_preemption_requested_tells_the_loop(tmp_path, full_run):
    # and hasten launch --preemption_signal USR1 reaches the workers through HASTEN_LAUNCH_CONFIG
    env = {"HASTEN_LAUNCH_CONFIG": json.dumps({"preemption_signal": "USR1"})}
    _stop_and_resume(tmp_path, full_run, 2, auto=False, sig=signal.SIGUSR1, env=env)


def _ignores_the_flag():
    accelerator, model, optimizer, loader, scheduler = _NS["build"](None, False)
    try:
        for index, (x, y) in enumerate(loader):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            if index == 2:
                os.kill(os.getpid(), signal.SIGTERM)
    except preemption.Preempted as exc:
        return exc.code, preemption.PREEMPTION.steps
    return "the loop ran to its end"


def test_a_loop_that_never_reads_the_flag_stops_at_the_next_batch_and_says_nothing_was_saved(capfd):
    # Without automatic naming and without `preemption_requested` in the loop, SIGTERM must not be swallowed: the
    # prepared loader's next batch after step S ends the process with exit code 75 and one line.
    [(code, steps)] = run_on_ranks(_ignores_the_flag, world_size=1)
    assert code == PREEMPTED_EXIT_CODE and steps == 4  # signalled after step 3: S = 4
    out = capfd.readouterr().out
    assert "every rank stopped after optimizer step 4" in out and "no checkpoint was written" in out, out


def _profiled_steps(n):
    """Run ``n`` armed training steps under a profiler; the store and collective calls of the main thread."""
    accelerator, model, optimizer, loader, scheduler = _NS["build"](None, False)
    assert preemption._RUNNING["watcher"] is not None  # armed by prepare()
    import torch.distributed as dist

    c10d = dist.distributed_c10d
    calls: list[str] = []

    def profile(frame, event, arg):
        if event == "c_call" and isinstance(getattr(arg, "__self__", None), dist.Store):
            calls.append(f"store.{arg.__name__}")
        elif event == "call" and frame.f_code.co_filename in (c10d.__file__, preemption.__file__):
            calls.append(frame.f_code.co_name)

    batches = iter(loader)
    x, y = next(batches)
    sys.setprofile(profile)  # this (main) thread only: the watcher's polls are not counted
    try:
        for _ in range(n):
            with accelerator.accumulate(model):
                accelerator.backward(nn.functional.mse_loss(model(x), y))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            x, y = next(batches)
    finally:
        sys.setprofile(None)
    return calls, threading.main_thread().ident


def test_a_normal_step_makes_no_store_or_collective_call():
    # DDP's gradient all-reduce runs in C++ (not a Python call): what remains are hasten's own additions.
    for calls, _ in run_on_ranks(_profiled_steps, world_size=2, args=(6,)):
        assert not [c for c in calls if c.startswith("store.")], calls
        assert not [c for c in calls if c in {"after_step", "at_boundary"}], calls
        collectives = {c for c in calls if not c.startswith("_")} & {
            "all_reduce", "broadcast", "barrier", "all_gather", "all_gather_object", "broadcast_object_list",
            "monitored_barrier", "reduce", "gather", "scatter", "all_to_all"}
        assert not collectives, collectives


def _launch(tmp_path, *args):
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", HASTEN_HOME=str(tmp_path / "home"))
    env.pop("HASTEN_LAUNCH_CONFIG", None)
    return subprocess.Popen([sys.executable, "-m", "hasten.commands.main", "launch", "--cpu", "--num_processes", "2",
                             "--preemption_grace", "60", *map(str, args)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


@pytest.mark.launch
def test_sigterm_to_hasten_launch_checkpoints_exits_75_and_the_relaunch_resumes(tmp_path, full_run):
    script, project, marker = tmp_path / "train.py", tmp_path / "project", tmp_path / "mark"
    script.write_text(SCRIPT)
    proc = _launch(tmp_path, script, project, tmp_path / "first.pt", marker)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # waiting for the file (no fixed delay: the workers wait for the signal)
        assert marker.exists(), proc.communicate(timeout=30)[0]
        proc.send_signal(signal.SIGTERM)  # the launcher only, as Kubernetes signals a pod's first process
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == PREEMPTED_EXIT_CODE, out
    assert re.search(r"every worker stopped after optimizer step \d+ with checkpoint .*checkpoint_0; "
                     r"[\d.]+ s from the signal to the exit", out), out
    first, end = torch.load(tmp_path / "first.pt")
    assert end[0] == "stopped" and os.path.isdir(project / "checkpoints" / "checkpoint_0")
    relaunch = _launch(tmp_path, script, project, tmp_path / "rest.pt")
    out, _ = relaunch.communicate(timeout=240)
    assert relaunch.returncode == 0, out
    rest, end = torch.load(tmp_path / "rest.pt")
    assert first + rest == full_run[0][0]
    assert end[0] == "done" and all(torch.equal(a, b) for a, b in zip(full_run[0][1][1], end[1]))


def test_signal_names_and_refusals():
    assert preemption.signal_number(None) is signal.SIGTERM
    assert preemption.signal_number("usr1") is signal.SIGUSR1
    assert preemption.signal_number("SIGUSR2") is signal.SIGUSR2
    assert preemption.signal_number(str(int(signal.SIGUSR1))) is signal.SIGUSR1
    with pytest.raises(ValueError, match="not a signal name"):
        preemption.signal_number("NOPE")


# Run in a child process (a deadlock must not hang the suite): arm the handler, then re-enter it at every call
# and return inside its first run, which is what a second signal arriving mid-handler does. Under SLURM the
# worker gets the signal twice (slurmstepd signals every process of the step and the launcher forwards it);
# a handler that took a lock (threading.Event.set) deadlocked the main thread there.
_REENTER = """
import signal, sys
from hasten.runtime import preemption
preemption.arm(store=None, rank=0, world=1, signal_name="USR1", env={}, stop_action=None, marker_dir=None)
tried = set()
def again_inside(frame, event, arg):
    depth, f = 0, frame
    while f is not None:
        depth += f.f_code is preemption._on_signal.__code__
        f = f.f_back
    where = (event, frame.f_code.co_name, getattr(arg, "__name__", None))
    if depth == 1 and where not in tried:
        tried.add(where)
        signal.raise_signal(signal.SIGUSR1)
sys.setprofile(again_inside)
signal.raise_signal(signal.SIGUSR1)
sys.setprofile(None)
print(len(tried), preemption.PREEMPTION.signalled, preemption.PREEMPTION.signal_name)
"""


def test_a_signal_arriving_inside_the_handler_does_not_deadlock():
    try:
        done = subprocess.run([sys.executable, "-c", _REENTER], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("the preemption signal handler deadlocked when a second signal arrived inside it")
    assert done.returncode == 0, done.stderr
    tried, signalled, name = done.stdout.split()
    assert int(tried) >= 2 and signalled == "True" and name == "SIGUSR1", done.stdout


class _Done:
    def __init__(self, code=0, out="", err=""):
        self.returncode, self.stdout, self.stderr = code, out, err


def test_slurm_requeue_decision():
    from hasten.environments.slurm import requeue_job

    calls = []

    def scontrol(answers):
        def run(argv, **kwargs):
            calls.append(argv[1:])
            answer = answers.pop(0)
            if isinstance(answer, BaseException):
                raise answer
            return answer
        return run

    assert requeue_job({}, scontrol([])) is None and calls == []  # not a SLURM job: nothing to do
    message = requeue_job({"SLURM_JOB_ID": "7"}, scontrol([_Done(out="JobId=7 Requeue=1"), _Done()]))
    assert calls == [["show", "job", "7"], ["requeue", "7"]] and "requeued" in message
    calls.clear()
    message = requeue_job({"SLURM_JOB_ID": "7"}, scontrol([_Done(out="JobId=7 Requeue=0 Restarts=0")]))
    assert calls == [["show", "job", "7"]] and "Requeue=0" in message and "--requeue" in message
    message = requeue_job({"SLURM_JOB_ID": "7"}, scontrol([_Done(), _Done(1, err="Access/permission denied")]))
    assert message == "SLURM refused to requeue job 7: Access/permission denied"
    message = requeue_job({"SLURM_JOB_ID": "7"}, scontrol([FileNotFoundError(2, "No such file", "scontrol")]))
    assert message.startswith("could not requeue SLURM job 7")
