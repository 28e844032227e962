"""``hasten launch --replica_groups N``: N independent replica groups and a Lighthouse (torchft).

The launch's ``--num_processes`` (the total, as everywhere) is split into N groups of equal size. Each group is
a torchrun agent of its own (its own rendezvous and store, on a free port), forked from this launcher once it
has imported torchrun's agent (and torch with it), so that a restarted group does not import them again. A group that exits non-zero is started again (same group id) while another group is
still training and the restart budget lasts; it heals from a live peer in its first quorum. When every group
has finished, the Lighthouse is stopped, so that no late group forms a quorum alone and trains on.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from multiprocessing.connection import wait
from typing import Any

from hasten.config.env import PREEMPTION_DIR_VAR
from hasten.exceptions import ConfigurationError, LaunchError
from hasten.fault_tolerance.timeouts import (
    FAULT_TOLERANCE_VAR,
    LIGHTHOUSE_VAR,
    NUM_REPLICA_GROUPS_VAR,
    REPLICA_GROUP_VAR,
    FaultToleranceConfig,
)
from hasten.launchers.plan import LaunchOptions, LaunchPlan

#: Group restarts allowed by default (each lost group uses one).
GROUP_RESTARTS = 3
#: Seconds stopping groups get (their agents stop their workers) before everything left is killed.
STOP_GRACE = 10.0


def plan_replica_groups(plan: LaunchPlan, options: LaunchOptions) -> None:
    """Turn ``plan`` into a replica-group launch, checking everything before anything starts.

    Raises:
        ConfigurationError: a group size that does not divide the processes, several machines, a timeout order
            that cannot work, or torchft missing.
    """
    groups = plan.config.replica_groups
    assert groups is not None
    total = plan.num_processes
    if groups < 1 or total % groups:
        raise ConfigurationError(f"--replica_groups={groups} must divide --num_processes={total} (the total over "
                                 "all groups): each group gets num_processes / replica_groups processes.")
    if plan.nnodes > 1 or plan.launcher not in ("torchrun", "process"):
        raise ConfigurationError(f"--replica_groups runs on one machine with torchrun's agent in this version (got "
                                 f"{plan.nnodes} machines, the {plan.launcher} launcher). HINT: start the Lighthouse "
                                 "yourself and pass --lighthouse ADDR to one `hasten launch` per group.")
    config = options.fault_tolerance or FaultToleranceConfig()
    config.timeouts(options.collective_timeout)  # refused here, at start, naming both values
    import importlib.util

    if importlib.util.find_spec("torchft") is None:
        raise ConfigurationError("--replica_groups needs torchft in the launcher's and the workers' Python: "
                                 "`pip install hasten[torchft]` (torchft==0.2.0).")
    plan.launcher = "replica-groups"
    plan.nproc_per_node = total // groups
    plan.env[FAULT_TOLERANCE_VAR] = config.to_json()
    plan.env[NUM_REPLICA_GROUPS_VAR] = str(groups)
    plan.notes.append(f"{groups} replica groups of {plan.nproc_per_node} process(es), each its own rendezvous; "
                      f"Lighthouse {options.lighthouse or 'started by this launcher'}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _group_main(plan: LaunchPlan, options: LaunchOptions) -> None:
    """A forked group: a session of its own (so it can be stopped as a whole), then torchrun's agent."""
    os.setsid()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    from hasten.launchers.torchrun import run_torchrun

    code = 1
    try:
        code = run_torchrun(plan, options)
    except BaseException:  # noqa: BLE001 - os._exit below would end the process before Python prints it
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _descendants(root: int) -> list[int]:
    """The processes below ``root`` (torchrun starts its workers in sessions of their own)."""
    parents: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(name))
    found, todo = [], [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class _Lighthouse:
    """The Lighthouse process (or an address given with ``--lighthouse``)."""

    def __init__(self, options: LaunchOptions, config: FaultToleranceConfig) -> None:
        self.process: subprocess.Popen[str] | None = None
        if options.lighthouse:
            self.address = options.lighthouse if "://" in options.lighthouse else f"http://{options.lighthouse}"
            return
        timeouts = config.timeouts(options.collective_timeout)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "hasten.fault_tolerance.lighthouse", "--bind", "127.0.0.1:0",
             "--min_replicas", str(config.min_replicas), "--join_timeout", str(timeouts.join),
             "--heartbeat_timeout", str(timeouts.heartbeat)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        line = self.process.stdout.readline().strip()
        if not line.startswith("http"):
            self.stop()
            raise LaunchError(f"the Lighthouse did not start (it printed {line!r}); see its error above.")
        self.address = line

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_GRACE)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class _Groups:
    """The running groups: start, restart within the budget, stop."""

    def __init__(self, plan: LaunchPlan, options: LaunchOptions, lighthouse: _Lighthouse) -> None:
        self.plan, self.options, self.lighthouse = plan, options, lighthouse
        self.finished: list[int] = []  # groups that completed the run (exit 0)
        self.running: dict[int, Any] = {}
        self.context = multiprocessing.get_context("fork")  # torch is imported, no thread is started yet
        self.restarts_left = GROUP_RESTARTS if options.group_restarts is None else options.group_restarts

    def start(self, group: int) -> None:
        # Each group's agent gets a markers folder of its own (it makes one when none is given): the agent
        # removes its folder when it ends, so a shared one is gone under a group that is still training.
        env = {name: value for name, value in self.plan.env.items() if name != PREEMPTION_DIR_VAR}
        env.update({REPLICA_GROUP_VAR: str(group), LIGHTHOUSE_VAR: self.lighthouse.address})
        port = _free_port()
        config = dataclasses.replace(self.plan.config, main_process_port=port)
        group_plan = dataclasses.replace(self.plan, launcher="torchrun", env=env, master_port=port, config=config,
                                         notes=[], max_restarts=0, rdzv_backend="static")
        process = self.context.Process(target=_group_main, args=(group_plan, self.options), daemon=False)
        process.start()
        self.running[group] = process

    def stop(self) -> None:
        """SIGTERM every group's agent (it stops its workers), then SIGKILL whatever is left."""
        pids = [pid for process in self.running.values() if process.pid for pid in _descendants(process.pid)]
        for process in self.running.values():
            if process.exitcode is None and process.pid:
                os.kill(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE
        for process in self.running.values():
            process.join(max(0.0, deadline - time.monotonic()))
        for pid in [*pids, *(p.pid for p in self.running.values() if p.exitcode is None and p.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for process in self.running.values():
            process.join()
        self.running.clear()

    def watch(self) -> int:
        """Wait for every group; restart lost ones; the launch's exit code."""
        while self.running:
            wait([process.sentinel for process in self.running.values()])
            for group, process in list(self.running.items()):
                if process.exitcode is None:
                    continue
                process.join()
                del self.running[group]
                code = process.exitcode
                if code == 0:
                    if not self.finished:
                        # The run's last step is committed: no group may form a quorum alone after this (a
                        # restarted group that has not healed yet would train the run again from its start).
                        self.lighthouse.stop()
                    self.finished.append(group)
                    continue
                why = f"exited with code {code}" if code > 0 else f"was killed by signal {-code}"
                if self.finished:
                    print(f"hasten launch: replica group {group} {why} after group {self.finished[0]} finished the "
                          "run; it is not restarted.", file=sys.stderr, flush=True)
                    continue
                if not self.running:
                    print(f"hasten launch: replica group {group} {why} and no other group is training (nothing to "
                          "heal from): the run stops.", file=sys.stderr, flush=True)
                    return code if code > 0 else 128 - code
                if self.restarts_left <= 0:
                    print(f"hasten launch: replica group {group} {why}; no group restarts left (--group_restarts): "
                          "the other groups train on without it.", file=sys.stderr, flush=True)
                    continue
                self.restarts_left -= 1
                print(f"hasten launch: replica group {group} {why}; restarting it ({self.restarts_left} restart(s) "
                      "left); it heals from a live group.", file=sys.stderr, flush=True)
                self.start(group)
        return 0


def run_replica_groups(plan: LaunchPlan, options: LaunchOptions) -> int:
    """Start the Lighthouse and the groups, wait, restart lost groups, stop everything; the exit code."""
    config = options.fault_tolerance or FaultToleranceConfig()
    try:
        lighthouse = _Lighthouse(options, config)
    except LaunchError as exc:
        print(f"hasten launch: error: {exc}", file=sys.stderr)
        return 2
    groups = _Groups(plan, options, lighthouse)
    # torchrun's agent, imported once here: every group (and every restart of one) is forked with it loaded,
    # which saves a restarted group the agent's torch import (seconds on a loaded machine). Importing torch
    # starts no thread, so forking afterwards is as safe as a DataLoader's workers are.
    import torch.distributed.run  # noqa: F401

    import hasten.launchers.torchrun  # noqa: F401

    def stop_on_signal(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(signum)

    previous = {sig: signal.signal(sig, stop_on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for group in range(int(plan.config.replica_groups or 1)):
            groups.start(group)
        return groups.watch()
    except KeyboardInterrupt as exc:
        signum = int(exc.args[0]) if exc.args and isinstance(exc.args[0], int) else int(signal.SIGINT)
        print(f"hasten launch: stopped by signal {signal.Signals(signum).name}; every replica group was stopped.",
              file=sys.stderr, flush=True)
        return 128 + signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        groups.stop()
        lighthouse.stop()


__all__ = ["GROUP_RESTARTS", "plan_replica_groups", "run_replica_groups"]
