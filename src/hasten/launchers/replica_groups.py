"""``hasten launch --replica_groups N``: N independent replica groups and a Lighthouse (torchft).

The launch's ``--num_processes`` (the total, as everywhere) is split into N groups of equal size. Each group is
a torchrun agent of its own (its own rendezvous and store, on a free port), forked from this launcher once it
has imported torchrun's agent (and torch with it), so that a restarted group does not import them again. A group that exits non-zero is started again (same group id) while another group is
still training and the restart budget lasts; it heals from a live peer in its first quorum. When every group
has finished, the Lighthouse is stopped, so that no late group forms a quorum alone and trains on.

On several machines (``--num_machines M``, one ``hasten launch`` per machine as usual) each machine runs N / M
whole groups of its own processes, their stores on the machine's own address (the one facing machine 0); machine
0 runs the Lighthouse at the main address and port, and the other machines wait for it before starting their
groups. A group spanning machines is refused.
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
from urllib.parse import urlsplit

from hasten.config.env import PREEMPTION_DIR_VAR
from hasten.environments.network import bind_address
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

    On several machines each machine runs ``N / M`` whole groups of its own processes (machine ``r`` the groups
    ``r * N / M`` onwards); the Lighthouse runs on machine 0 at ``--main_process_ip:--main_process_port`` (the
    groups' rendezvous are each on their own machine, so that address is free for it) unless ``--lighthouse``
    names one.

    Raises:
        ConfigurationError: a group size that does not divide the processes, a group that would span machines,
            machines that come and go (``MIN:MAX``), a launcher other than torchrun's agent, a timeout order that
            cannot work, or torchft missing.
    """
    groups = plan.config.replica_groups
    assert groups is not None
    total, machines = plan.num_processes, plan.nnodes
    if groups < 1 or total % groups:
        raise ConfigurationError(f"--replica_groups={groups} must divide --num_processes={total} (the total over "
                                 "all groups): each group gets num_processes / replica_groups processes.")
    if plan.launcher not in ("torchrun", "process") or plan.min_nnodes:
        what = f"the {plan.launcher} launcher" if plan.launcher not in ("torchrun", "process") else \
            f"--num_machines {plan.min_nnodes}:{machines}"
        raise ConfigurationError(f"--replica_groups runs its groups with torchrun's agent on a fixed set of machines "
                                 f"(got {what}). HINT: run one `hasten launch --replica_groups N` per machine, "
                                 "without --use_mpi/SLURM tasks or MIN:MAX machines (lost groups are restarted "
                                 "and heal by themselves).")
    if groups % machines:
        fits = [k for k in range(machines, total + 1, machines) if total % k == 0]
        raise ConfigurationError(
            f"--replica_groups={groups} over --num_machines={machines}: every replica group runs on one machine, so "
            f"the groups must split evenly over the machines, and {groups} is not a multiple of {machines} (a group "
            f"spanning machines is not supported). HINT: with --num_processes={total}, pass --replica_groups "
            f"{' or '.join(map(str, fits[:4]))} (--replica_groups {machines}: one group per machine).")
    config = options.fault_tolerance or FaultToleranceConfig()
    config.timeouts(options.collective_timeout)  # refused here, at start, naming both values
    if config.min_replicas > groups:
        raise ConfigurationError(f"--min_replicas={config.min_replicas} is more than --replica_groups={groups}: no "
                                 f"step could commit. HINT: pass at most {groups}.")
    import importlib.util

    if importlib.util.find_spec("torchft") is None:
        raise ConfigurationError("--replica_groups needs torchft in the launcher's and the workers' Python: "
                                 "`pip install hasten[torchft]` (torchft==0.2.0).")
    plan.launcher = "replica-groups"
    plan.env[FAULT_TOLERANCE_VAR] = config.to_json()
    plan.env[NUM_REPLICA_GROUPS_VAR] = str(groups)
    size = total // groups
    if machines == 1:
        plan.notes.append(f"{groups} replica groups of {size} process(es), each its own rendezvous; "
                          f"Lighthouse {options.lighthouse or 'started by this launcher'}")
        return
    plan.env[LIGHTHOUSE_VAR] = _lighthouse_url(options.lighthouse or f"{plan.master_addr}:{plan.master_port}")
    mine = local_groups(plan)
    where = "given with --lighthouse" if options.lighthouse else \
        ("started on this machine (machine 0)" if plan.node_rank == 0 else "on machine 0")
    plan.notes.append(f"{groups} replica groups of {size} process(es) over {machines} machines, {len(mine)} per "
                      f"machine (machine m runs groups {len(mine)}*m to {len(mine)}*m+{len(mine) - 1}), each group "
                      f"on one machine with its own rendezvous; this machine ({plan.node_rank}) runs groups "
                      f"{', '.join(map(str, mine))}; Lighthouse {plan.env[LIGHTHOUSE_VAR]} {where}")


def local_groups(plan: LaunchPlan) -> list[int]:
    """The replica groups this machine runs: ``N / M`` consecutive ones, from ``machine_rank * N / M``."""
    per_machine = int(plan.config.replica_groups or 1) // plan.nnodes
    return list(range(plan.node_rank * per_machine, (plan.node_rank + 1) * per_machine))


def _lighthouse_url(address: str) -> str:
    return address if "://" in address else f"http://{address}"


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
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
    """The Lighthouse: started here (one machine, or machine 0 of several), on machine 0, or given (``--lighthouse``)."""

    def __init__(self, plan: LaunchPlan, options: LaunchOptions, config: FaultToleranceConfig) -> None:
        self.process: subprocess.Popen[str] | None = None
        timeouts = config.timeouts(options.collective_timeout)
        if options.lighthouse:
            self.address = _lighthouse_url(options.lighthouse)
            return
        if plan.nnodes > 1 and plan.node_rank > 0:  # machine 0's, at the main address
            self.address = plan.env[LIGHTHOUSE_VAR]
            _wait_until_listening(self.address, timeouts.collective)
            return
        bind = "127.0.0.1:0" if plan.nnodes == 1 else f"{plan.bind_addr}:{plan.master_port}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "hasten.fault_tolerance.lighthouse", "--bind", bind,
             "--min_replicas", str(config.min_replicas), "--join_timeout", str(timeouts.join),
             "--heartbeat_timeout", str(timeouts.heartbeat)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        line = self.process.stdout.readline().strip()
        if not line.startswith("http"):
            self.stop()
            raise LaunchError(f"the Lighthouse did not start on {bind} (it printed {line!r}); see its error above.")
        self.address = line

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_GRACE)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _wait_until_listening(address: str, timeout: float) -> None:
    """Wait (up to ``timeout`` seconds) until the Lighthouse at ``address`` accepts connections: machine 0 may start
    after this machine.

    Raises:
        LaunchError: nothing listens there in time.
    """
    url = urlsplit(address)
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((url.hostname or "", url.port or 80), timeout=1.0).close()
            return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise LaunchError(f"the Lighthouse at {address} (machine 0) did not answer within {timeout:g} s "
                                  f"({exc}). HINT: start machine 0's `hasten launch --replica_groups` too, with the "
                                  "same --main_process_ip and --main_process_port on every machine.") from exc
        time.sleep(0.2)  # polling a TCP port: there is nothing to wait on


class _Groups:
    """The running groups: start, restart within the budget, stop."""

    def __init__(self, plan: LaunchPlan, options: LaunchOptions, lighthouse: _Lighthouse) -> None:
        self.plan, self.options, self.lighthouse = plan, options, lighthouse
        self.finished: list[int] = []  # groups that completed the run (exit 0)
        self.running: dict[int, Any] = {}
        self.context = multiprocessing.get_context("fork")  # torch is imported, no thread is started yet
        self.restarts_left = GROUP_RESTARTS if options.group_restarts is None else options.group_restarts

    def start(self, group: int) -> None:
        """Fork group ``group``'s torchrun agent: one machine (this one), a store on this machine's address."""
        plan = self.plan
        # Each group's agent gets a markers folder of its own (it makes one when none is given): the agent
        # removes its folder when it ends, so a shared one is gone under a group that is still training.
        env = {name: value for name, value in plan.env.items() if name != PREEMPTION_DIR_VAR}
        env.update({REPLICA_GROUP_VAR: str(group), LIGHTHOUSE_VAR: self.lighthouse.address})
        host = plan.bind_addr or "127.0.0.1"  # several machines: the address this machine faces the others with
        port = _free_port(host)
        config = dataclasses.replace(plan.config, main_process_ip=host, main_process_port=port, num_machines=1,
                                     machine_rank=0, min_machines=None)
        group_plan = dataclasses.replace(plan, launcher="torchrun", env=env, config=config,
                                         nproc_per_node=plan.num_processes // int(plan.config.replica_groups or 1),
                                         nnodes=1, node_rank=0, min_nnodes=None, master_addr=host, master_port=port,
                                         bind_addr=host, notes=[], max_restarts=0, rdzv_backend="static",
                                         rdzv_conf=self.options.rdzv_conf)
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
                if not self.running and self.plan.nnodes == 1:  # (on several machines, others may be training)
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
        if plan.nnodes > 1 and not plan.bind_addr:  # the main address was not reachable when planning
            plan.bind_addr = bind_address(plan.master_addr, plan.nnodes)
        lighthouse = _Lighthouse(plan, options, config)
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
        for group in local_groups(plan):
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


__all__ = ["GROUP_RESTARTS", "local_groups", "plan_replica_groups", "run_replica_groups"]
