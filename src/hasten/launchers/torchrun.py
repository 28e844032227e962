"""Start the workers with torchrun's elastic agent, in this process (no second interpreter start-up).

The agent starts ``nproc_per_node`` workers, gives them torchrun's variables (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ...), stops the others as soon as one fails, restarts the group up to
``max_restarts`` times, and stops every worker on SIGINT/SIGTERM. Workers that stopped for preemption
(see :mod:`hasten.runtime.preemption`) exit 0 and leave a marker file, so the agent neither restarts
them nor counts a failure; the launcher then exits with ``PREEMPTED_EXIT_CODE`` (75).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hasten.base.environment import patch_environment
from hasten.config.env import PREEMPTION_DIR_VAR
from hasten.exceptions import LaunchError
from hasten.launchers.plan import HANG_EXIT_CODE, WORKER_MODULE, LaunchOptions, LaunchPlan
from hasten.runtime.preemption import PREEMPTED_EXIT_CODE, signal_number

if TYPE_CHECKING:
    from hasten.launchers.machines.watch import ElasticWatch

#: ``hasten launch``'s exit status when the network check failed (as when the machines could not meet).
NETWORK_CHECK_EXIT_CODE = 1
#: The signals torchrun's agent handles by default (it stops the workers on each).
_AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


def torchrun_argv(plan: LaunchPlan, options: LaunchOptions) -> list[str]:
    """The ``torch.distributed.run`` arguments for ``plan`` (what ``torchrun`` would be given).

    Example:
        >>> torchrun_argv(plan, options)[:4]  # doctest: +SKIP
        ['--nnodes', '1', '--nproc_per_node', '2']
    """
    nnodes = f"{plan.min_nnodes}:{plan.nnodes}" if plan.min_nnodes else str(plan.nnodes)
    argv = ["--nnodes", nnodes, "--nproc_per_node", str(plan.nproc_per_node),
            "--node_rank", str(plan.node_rank), "--master_addr", plan.master_addr,
            "--master_port", str(plan.master_port), "--rdzv_backend", plan.rdzv_backend,
            "--rdzv_endpoint", f"{plan.master_addr}:{plan.master_port}",
            "--max_restarts", str(plan.max_restarts), "--monitor_interval", str(options.monitor_interval),
            "--role", options.role, "--tee", options.tee]
    if plan.rdzv_conf:
        argv += ["--rdzv_conf", plan.rdzv_conf]
    argv += _preemption_argv(plan, options)
    if plan.rdzv_backend != "static":
        argv += ["--rdzv_id", "hasten"]
    if plan.bind_addr:
        argv += ["--local_addr", plan.bind_addr]
    if options.log_dir:
        argv += ["--log_dir", options.log_dir]
    if options.no_python:
        return [*argv, "--no_python", options.script, *options.script_args]
    # Python workers go through hasten's bootstrap, which ends a finished script without the
    # interpreter finalization where gloo can abort (see hasten.launchers.worker).
    target = ["--module"] if options.module else []
    return [*argv, "--module", WORKER_MODULE, *target, options.script, *options.script_args]


def _preemption_argv(plan: LaunchPlan, options: LaunchOptions) -> list[str]:
    """The agent forwards the preemption signal to the workers and waits ``--preemption_grace`` before SIGKILL."""
    argv: list[str] = []
    name = plan.config.preemption_signal
    if name:
        sig = signal_number(name).name
        if sig not in _AGENT_SIGNALS:  # the agent's own list, else that signal would end the launcher at once
            argv += ["--signals_to_handle", ",".join((*_AGENT_SIGNALS, sig))]
    if options.preemption_grace is not None:
        argv += ["--shutdown_timeout", str(math.ceil(options.preemption_grace))]
    return argv


def _added_environment(extra: Mapping[str, str]) -> Any:
    # Workers (forked ranks, or the agent's children) copy this process's environment, so the
    # variables are set here for the duration of the launch.
    return patch_environment(**extra)


def run_torchrun(plan: LaunchPlan, options: LaunchOptions) -> int:
    """Run the plan under the elastic agent; return the exit code (the failed worker's, if any)."""
    from hasten.launchers.machines.reports import present

    with contextlib.ExitStack() as stack:
        if plan.nnodes > 1:
            # Marked now, seconds before the network check (torch is not imported yet): with a loopback
            # address, the other machines' checks then know that this one runs here and is only starting.
            stack.enter_context(present(plan.master_port, plan.node_rank))
        return _run(plan, options)


def _run(plan: LaunchPlan, options: LaunchOptions) -> int:
    from torch.distributed import DistNetworkError, DistStoreError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import (
        RendezvousClosedError,
        RendezvousError,
        RendezvousTimeoutError,
    )
    from torch.distributed.run import get_args_parser, run

    from hasten.environments.network import bind_address
    from hasten.launchers.machines.store import store_server

    try:
        plan.bind_addr = plan.bind_addr or bind_address(plan.master_addr, plan.nnodes)
    except LaunchError as exc:
        print(f"hasten launch: error: {exc}", file=sys.stderr)
        return 2
    args = get_args_parser().parse_args(torchrun_argv(plan, options))
    if plan.rdzv_backend == "c10d" and plan.nnodes > 1:  # the same c10d rendezvous, plus a line per round
        from hasten.launchers.machines.membership import use_membership_backend

        args.rdzv_backend = use_membership_backend(f"{socket.gethostname()} ({plan.bind_addr})", plan.nproc_per_node)
    agent_env = dict(plan.env)  # the plan holds every variable the workers get (listening, preemption markers)
    hosts_store = plan.node_rank == 0 if plan.rdzv_backend == "static" else (plan.nnodes == 1 or plan.node_rank == 0)
    markers = agent_env.get(PREEMPTION_DIR_VAR) or tempfile.mkdtemp(prefix="hasten-preempt-")
    os.makedirs(markers, mode=0o700, exist_ok=True)  # workers stopped by preemption leave a file here
    agent_env[PREEMPTION_DIR_VAR] = markers
    started = time.time()
    watch: ElasticWatch | None = None  # machine 0 of a MIN:MAX launch: the others' UDP reports
    with _added_environment(agent_env), contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, markers, True)
        try:
            if hosts_store:
                stack.enter_context(store_server(plan.bind_addr, plan.master_port))
            if plan.min_nnodes and plan.nnodes > 1 and plan.node_rank == 0 and not options.check_network:
                from hasten.launchers.machines.watch import ElasticWatch

                # Bound before the check, so that no report of a machine that cannot reach the port is lost.
                watch = stack.enter_context(ElasticWatch(plan.bind_addr, plan.master_addr, plan.master_port,
                                                         plan.min_nnodes, plan.nnodes))
            if plan.nnodes > 1:
                failed = _network_check(plan, options)
                if failed is not None or options.check_network:
                    return failed or 0
            run(args)
        except ChildFailedError as exc:
            return _report_failure(exc, options.quiet)
        except SignalException as exc:
            if _report_preemption(markers, plan.nproc_per_node, started):
                return PREEMPTED_EXIT_CODE
            print(f"hasten launch: stopped by signal {exc.sigval.name}; all workers were terminated.",
                  file=sys.stderr)
            return 128 + int(exc.sigval)
        except RendezvousClosedError:
            return _closed_rendezvous(plan, watch)
        except RendezvousTimeoutError as exc:  # c10d: fewer than MIN machines joined in time
            from hasten.launchers.machines.watch import timeout_problem

            endpoint = f"{plan.master_addr}:{plan.master_port}"
            line = watch.timeout_problem(endpoint, exc) if watch is not None else \
                timeout_problem(endpoint, plan.master_port, plan.min_nnodes, plan.nnodes, exc)
            print(f"hasten launch: {line}", file=sys.stderr, flush=True)
            return 1
        except (RendezvousError, DistStoreError, DistNetworkError) as exc:  # static rendezvous: its store timed out
            print(f"hasten launch: the machines could not meet at {plan.master_addr}:{plan.master_port} "
                  f"({type(exc).__name__}: {exc}). HINT: check --main_process_ip/--main_process_port, that every "
                  "machine uses the same values and --num_machines, and that the port is reachable.",
                  file=sys.stderr)
            return 1
        except LaunchError as exc:
            print(f"hasten launch: error: {exc}", file=sys.stderr)
            return 2
        if _report_preemption(markers, plan.nproc_per_node, started):  # signalled workers, not this launcher
            return PREEMPTED_EXIT_CODE
    return 0


def _closed_rendezvous(plan: LaunchPlan, watch: ElasticWatch | None) -> int:
    """MIN:MAX: machine 0's watch closed the rendezvous (too few machines can join); print its line everywhere."""
    from hasten.launchers.machines.watch import recorded_problem

    line = watch.fatal if watch is not None else recorded_problem(plan.master_addr, plan.master_port)
    if line is None:
        print(f"hasten launch: the rendezvous at {plan.master_addr}:{plan.master_port} was closed before this machine "
              "joined a round: the run ended or stopped. HINT: see machine 0's output", file=sys.stderr, flush=True)
        return 1
    print(f"hasten launch: network check failed: {line}", file=sys.stderr, flush=True)
    if watch is not None:
        watch.linger()  # machine 0 hosts the store the others read the line from
    return NETWORK_CHECK_EXIT_CODE


def _report_preemption(folder: str, nproc: int, started: float) -> bool:
    """True when every local worker stopped for preemption; logs where, the checkpoint and signal-to-exit time.

    Each worker's marker holds three lines: the time it got (or learned of) the signal, where every
    rank stopped, and the checkpoint folder (empty when the script could not save one).
    """
    found = []
    for name in os.listdir(folder):
        if name.startswith("rank") and not name.endswith(".tmp"):
            with open(os.path.join(folder, name)) as f:
                found.append((f.read().split("\n") + ["", ""])[:3])
    if len(found) < nproc:
        return False
    signalled = min(float(parts[0]) for parts in found)
    where, target = found[0][1], found[0][2].strip()
    saved = f"with checkpoint {target}" if target else "without a checkpoint"
    then = ("relaunch to resume (Accelerator.load_state() loads the newest checkpoint)" if target else
            "the script saved nothing, so a relaunch starts it over")
    print(f"hasten launch: preempted: every worker stopped {where} {saved}; "
          f"{time.time() - max(signalled, started):.1f} s from the signal to the exit. Exit code "
          f"{PREEMPTED_EXIT_CODE}: {then}.", file=sys.stderr, flush=True)
    return True


def _network_check(plan: LaunchPlan, options: LaunchOptions) -> int | None:
    """Multi-machine launches: check the network before the rendezvous; the exit code if it failed, else None."""
    from hasten.launchers.machines.check import (
        NetworkCheckFailed,
        check_network,
        describe,
        rendezvous_timeout,
    )

    endpoint = f"{plan.master_addr}:{plan.master_port}"
    print(f"hasten launch: checking the network: machine {plan.node_rank} of {plan.nnodes}, rendezvous {endpoint}, "
          f"advertising {plan.bind_addr}", file=sys.stderr, flush=True)
    try:
        peers = check_network(plan.bind_addr, plan.master_addr, plan.master_port, plan.node_rank, plan.nnodes,
                              os.environ, rendezvous_timeout(plan.rdzv_conf), meet=plan.min_nnodes is None)
    except NetworkCheckFailed as exc:
        print(f"hasten launch: network check failed: {exc}", file=sys.stderr, flush=True)
        return NETWORK_CHECK_EXIT_CODE
    print(f"hasten launch: {describe(peers, endpoint, met=plan.min_nnodes is None)}", file=sys.stderr, flush=True)
    if plan.min_nnodes and plan.node_rank != 0 and not options.check_network:
        from hasten.launchers.machines.watch import joined

        joined(plan.master_addr, plan.master_port)  # machine 0 keeps its store for this one if it must stop all
    return None


def _report_failure(exc: Exception, quiet: bool) -> int:
    failures = exc.failures  # type: ignore[attr-defined]  # global rank -> ProcessFailure
    first_rank, first = exc.get_first_failure()  # type: ignore[attr-defined]
    described = []
    for rank in sorted(failures):
        code = failures[rank].exitcode
        described.append(f"rank {rank} " + (f"exited with code {code}" if code >= 0 else f"killed by signal {-code}"))
    if any(failure.exitcode == HANG_EXIT_CODE for failure in failures.values()):
        described.append(f"code {HANG_EXIT_CODE}: stopped by hasten's hang watchdog, whose report is above")
    print(f"hasten launch: {len(failures)} worker(s) failed ({'; '.join(described)}); the other workers were "
          "stopped. The tracebacks are printed above (the root cause is usually the one that is not "
          "'Connection closed by peer').", file=sys.stderr)
    if not quiet and first.error_file and os.path.isfile(first.error_file):
        print(f"rank {first_rank}: {first.message}", file=sys.stderr)
    code = first.exitcode
    return code if code > 0 else (128 - code if code < 0 else 1)
