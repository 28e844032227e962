"""Per-step fault tolerance (replica groups on torchft) against hasten's restart-and-resume, on one failure.

Workload: 4 CPU processes, a tiny model, ``--samples`` samples in one epoch (batch 4 per process, so 16 per step
with everyone in), emulated compute of ``--step-s`` seconds per step (a sleep, so that the timings measure the
machinery and not this shared machine's load). One process SIGKILLs itself at committed step ``--kill-at``.

- replica groups: ``hasten launch --num_processes 4 --replica_groups 2``; the launcher restarts the lost group at
  once and it heals from the survivor. Reported: kill -> the survivors' next committed step, restart (the new
  process's start) -> the healed group's first committed step (split into process start-up up to ``prepare``,
  and ``prepare`` -> first commit: Manager, quorum, heal, one step), kill -> that commit, whether
  the final weights of all 4 processes are bit-equal, and the epoch's sample ids over the committed steps
  (duplicates, missing).
  With ``--restart-at STEP`` (issue 38's drill: killed at step 20, restarted at step 30) the restarted group's
  processes first wait until the survivors committed ``STEP`` (polling their step log), and the restart times
  count from then; restart-and-resume still restarts at once (with no survivor, a later restart only idles
  every process longer).
- restart-and-resume: ``hasten launch --num_processes 4 --max_restarts 1``, ``save_state`` every
  ``--checkpoint-every`` steps; the agent restarts every process, which load the newest checkpoint and skip the
  batches already seen.

Two measures of what the failure cost, per mode: the idle process-seconds (processes that do no useful work: under
replica groups the survivors until their next commit and the lost group until its first healed commit; under
restart-and-resume every process until it is back at the step it had reached), and the wall seconds the run took
longer than the same run without a kill (a survivor that trains alone covers the lost group's samples in more,
smaller steps, so it pays for the outage in wall time too).

    python benchmarks/bench_fault_tolerance.py            # with the torchft venv: .tft-venv/bin/python
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r'''
import time
T0 = time.time()
import glob, hashlib, json, os, signal, sys

def wait_for_survivors(out, step):
    """A restarted group's process under --restart-at: back only once the survivors committed ``step``."""
    while True:
        for path in glob.glob(os.path.join(out, "steps_g0_*.jsonl")):
            with open(path) as f:
                for line in f:
                    row = json.loads(line) if line.endswith("\n") else {}
                    if row.get("event") == "step" and row["committed"] and row["step"] >= step:
                        return
        time.sleep(0.05)  # a benchmark's poll of another process's progress file

RELEASED = T0
if sys.argv[1] == "ft" and int(sys.argv[7]) and os.environ.get("HASTEN_REPLICA_GROUP") == "1" and \
        os.path.exists(os.path.join(sys.argv[2], "killed")):
    wait_for_survivors(sys.argv[2], int(sys.argv[7]))
    RELEASED = time.time()  # the restart, as the drill schedules it: heal times are measured from here
import torch
from torch.utils.data import DataLoader, TensorDataset
from hasten import Accelerator, ProjectConfiguration

mode, out, samples, step_s, kill_at, every = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), \
    int(sys.argv[5]), int(sys.argv[6])
project = os.path.join(out, "project")
accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=project,
                                                                        automatic_checkpoint_naming=True))
group = os.environ.get("HASTEN_REPLICA_GROUP", "0")
rank = accelerator.process_index
torch.manual_seed(0)
features = torch.randn(samples, 16)
dataset = TensorDataset(torch.arange(samples), features, features @ torch.randn(16, 4))
loader = DataLoader(dataset, batch_size=4, shuffle=(mode == "ft"))
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
T_PREPARE = time.time()  # the replica group joins its first quorum (and heals) inside prepare
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
log = open(os.path.join(out, f"steps_g{group}_r{rank}_{os.getpid()}.jsonl"), "a", buffering=1)
log.write(json.dumps({"event": "start", "t": T0, "released": RELEASED, "prepare": T_PREPARE,
                      "prepared": time.time()}) + "\n")
step = 0
if mode == "resume":
    folder = os.path.join(project, "checkpoints")
    if os.path.isdir(folder) and os.listdir(folder):
        newest = max(os.listdir(folder), key=lambda name: int(name.rsplit("_", 1)[1]))
        accelerator.load_state(os.path.join(folder, newest))
        step = json.load(open(os.path.join(folder, newest, "step.json")))["step"]
        loader = accelerator.skip_first_batches(loader, step)
        log.write(json.dumps({"event": "resumed", "t": time.time(), "step": step}) + "\n")
marker = os.path.join(out, "killed")
for ids, x, y in loader:
    loss = torch.nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    time.sleep(step_s)  # emulated compute
    if mode == "ft":
        step, committed = accelerator.replica_group.manager.current_step(), not optimizer.step_was_skipped
        padded = loader.padded
    else:
        step, committed, padded = step + 1, True, False
    log.write(json.dumps({"event": "step", "t": time.time(), "step": step, "committed": committed,
                          "ids": ids.tolist(), "padded": padded}) + "\n")
    if mode == "resume" and step % every == 0:
        accelerator.save_state()
        if accelerator.is_main_process:
            newest = max(os.listdir(os.path.join(project, "checkpoints")), key=lambda n: int(n.rsplit("_", 1)[1]))
            json.dump({"step": step}, open(os.path.join(project, "checkpoints", newest, "step.json"), "w"))
        accelerator.wait_for_everyone()
    if kill_at and group == "1" and rank == 0 and step >= kill_at and not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write(str(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    if kill_at and mode == "resume" and rank == 1 and step >= kill_at and not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write(str(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
weights = b"".join(p.detach().numpy().tobytes() for p in accelerator.unwrap_model(model).parameters())
with open(os.path.join(out, f"final_g{group}_r{rank}_{os.getpid()}.json"), "w") as f:
    json.dump({"digest": hashlib.sha256(weights).hexdigest(), "step": step}, f)
'''


def launch(mode: str, out: Path, args: argparse.Namespace, kill: bool) -> float:
    """One ``hasten launch``; its wall seconds (every process it started is stopped on the way out)."""
    out.mkdir(parents=True)
    script = out / "train.py"
    script.write_text(SCRIPT)
    flags = ["--replica_groups", "2", "--step_timeout", str(args.step_timeout)] if mode == "ft" else \
        ["--max_restarts", "1"]
    command = [sys.executable, "-m", "hasten.commands.main", "launch", "--cpu", "--num_processes", "4", *flags,
               str(script), mode, str(out), str(args.samples), str(args.step_s), str(args.kill_at if kill else 0),
               str(args.checkpoint_every), str(args.restart_at if kill else 0)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    started = time.time()
    with open(out / "launch.log", "w") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=args.timeout)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(60)
    if code != 0:
        raise SystemExit(f"{mode} run exited with {code}; see {out / 'launch.log'}")
    return time.time() - started


def _rows(out: Path) -> dict[str, list[dict[str, Any]]]:
    """Each process incarnation's log rows, by file name."""
    return {path.name: [json.loads(line) for line in path.read_text().splitlines()]
            for path in sorted(out.glob("steps_*.jsonl"))}


def replica_figures(out: Path) -> dict[str, Any]:
    """The drill's figures from the logs of a replica-group run with a kill."""
    killed_at = float((out / "killed").read_text())
    logs = _rows(out)
    survivor = [row for name, rows in logs.items() if name.startswith("steps_g0_") for row in rows
                if row["event"] == "step" and row["committed"]]
    # The killed process logged its last committed step just before the kill; the survivors' next commit is the
    # first of a later step (their commit of that same step may land just after the kill).
    killed_step = max(row["step"] for name, rows in logs.items() if name.startswith("steps_g1_")
                      and rows[0]["t"] < killed_at for row in rows if row["event"] == "step" and row["committed"])
    next_commit = min(row["t"] for row in survivor if row["step"] > killed_step) - killed_at
    restarted = [rows for name, rows in logs.items() if name.startswith("steps_g1_")
                 and rows[0]["t"] > killed_at]
    heal = []
    for rows in restarted:
        commits = [row["t"] for row in rows if row["event"] == "step" and row["committed"]]
        if commits:
            start = rows[0]
            restart = start["released"]  # the process start, or the end of its --restart-at wait
            heal.append((commits[0] - restart, start["prepare"] - restart, commits[0] - start["prepare"],
                         commits[0] - killed_at))
    finals = [json.loads(path.read_text()) for path in out.glob("final_*.json")]
    by_step = collections.Counter(i for rows in logs.values() for row in rows
                                  if row["event"] == "step" and row["committed"] and not row["padded"]
                                  for i in row["ids"])
    samples = len({i for i in by_step})
    return {"kill_to_survivor_commit_s": next_commit,
            "restart_to_healed_commit_s": max(h[0] for h in heal) if heal else None,
            "healed_process_start_s": max(h[1] for h in heal) if heal else None,
            "healed_heal_and_first_step_s": max(h[2] for h in heal) if heal else None,
            "kill_to_healed_commit_s": max(h[3] for h in heal) if heal else None,
            "kill_to_restarted_start_s": max(h[3] - h[0] for h in heal) if heal else None,
            "final_processes": len(finals), "weights_bit_equal": len({f["digest"] for f in finals}) == 1,
            "samples_seen": samples, "duplicates": sum(1 for n in by_step.values() if n > 1)}


def resume_figures(out: Path, kill_at: int) -> dict[str, Any]:
    """Restart-and-resume: kill -> every restarted process is back at the step it had reached."""
    killed_at = float((out / "killed").read_text())
    back = []
    for rows in _rows(out).values():
        if rows[0]["t"] > killed_at:  # a restarted process
            steps = [row["t"] for row in rows if row["event"] == "step" and row["step"] >= kill_at]
            if steps:
                back.append(steps[0])
    return {"kill_to_back_at_kill_step_s": max(back) - killed_at if back else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--step-s", type=float, default=0.25)
    parser.add_argument("--kill-at", type=int, default=20)
    parser.add_argument("--checkpoint-every", type=int, default=8)
    parser.add_argument("--restart-at", type=int, default=0,
                        help="replica groups: the restarted group's processes wait until the survivors committed "
                             "this step (issue 38's drill: killed at 20, restarted at 30); heal times count from "
                             "then. 0: at once (the launcher's restart)")
    parser.add_argument("--step-timeout", type=float, default=5.0)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="bench_ft_"))
    walls = {}
    for mode in ("ft", "resume"):
        for kill in (False, True):
            walls[(mode, kill)] = launch(mode, root / f"{mode}_{'kill' if kill else 'clean'}", args, kill)
            print(f"{mode:6} {'kill' if kill else 'clean':5}: {walls[(mode, kill)]:.1f} s wall", flush=True)
    figures = replica_figures(root / "ft_kill")
    resumed = resume_figures(root / "resume_kill", args.kill_at)
    lost = {mode: walls[(mode, True)] - walls[(mode, False)] for mode in ("ft", "resume")}
    # Process-seconds without useful work: the survivors until their next commit and the lost group until its
    # first healed commit; under restart-and-resume every process until it is back at the step it had reached.
    idle_ft = 2 * figures["kill_to_survivor_commit_s"] + 2 * (figures["kill_to_healed_commit_s"] or 0.0)
    idle_resume = 4 * (resumed["kill_to_back_at_kill_step_s"] or 0.0)
    # With --restart-at, the lost group's scheduled outage (kill -> restart) is the drill's, not the machinery's.
    idle_ft_after_restart = 2 * figures["kill_to_survivor_commit_s"] + 2 * (figures["restart_to_healed_commit_s"]
                                                                             or 0.0)
    result = {**figures, **resumed, "samples": args.samples,
              "replica_groups_idle_process_s": idle_ft, "restart_at": args.restart_at,
              "replica_groups_idle_process_s_outage_excluded": idle_ft_after_restart, "restart_resume_idle_process_s": idle_resume,
              "replica_groups_seconds_lost": lost["ft"], "restart_resume_seconds_lost": lost["resume"],
              "replica_groups_process_seconds_lost": 4 * lost["ft"],
              "restart_resume_process_seconds_lost": 4 * lost["resume"],
              "walls": {f"{mode}_{'kill' if kill else 'clean'}": wall for (mode, kill), wall in walls.items()},
              "out": str(root)}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
