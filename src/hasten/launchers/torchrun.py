"""Start the workers with torchrun's elastic agent, in this process (no second interpreter start-up).

The agent starts ``nproc_per_node`` workers, gives them torchrun's variables (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ...), stops the others as soon as one fails, restarts the group up to
``max_restarts`` times, and stops every worker on SIGINT/SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from collections.abc import Mapping
from typing import Any

from hasten.base.environment import patch_environment
from hasten.exceptions import LaunchError
from hasten.launchers.plan import HANG_EXIT_CODE, WORKER_MODULE, LaunchOptions, LaunchPlan

#: ``hasten launch``'s exit status when the network check failed (as when the machines could not meet).
NETWORK_CHECK_EXIT_CODE = 1


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


def _added_environment(extra: Mapping[str, str]) -> Any:
    # Workers (forked ranks, or the agent's children) copy this process's environment, so the
    # variables are set here for the duration of the launch.
    return patch_environment(**extra)


def run_torchrun(plan: LaunchPlan, options: LaunchOptions) -> int:
    """Run the plan under the elastic agent; return the exit code (the failed worker's, if any)."""
    from torch.distributed import DistNetworkError, DistStoreError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import get_args_parser, run

    from hasten.launchers.network import bind_address, interface_of, store_server

    try:
        plan.bind_addr = plan.bind_addr or bind_address(plan.master_addr, plan.nnodes)
    except LaunchError as exc:
        print(f"hasten launch: error: {exc}", file=sys.stderr)
        return 2
    args = get_args_parser().parse_args(torchrun_argv(plan, options))
    if plan.rdzv_backend == "c10d" and plan.nnodes > 1:  # the same c10d rendezvous, plus a line per round
        from hasten.launchers.elastic import use_membership_backend

        args.rdzv_backend = use_membership_backend(f"{socket.gethostname()} ({plan.bind_addr})", plan.nproc_per_node)
    agent_env = dict(plan.env)
    if plan.rdzv_backend == "c10d":
        # Not the agent's shared store (torch binds it on every interface, on a port hasten cannot choose):
        # worker rank 0 hosts the process group's store, bound by hasten's worker bootstrap. It also
        # gives each restarted round a fresh store, without the dead round's keys (a dead peer's address).
        agent_env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    interface = interface_of(plan.bind_addr)
    if interface and "GLOO_SOCKET_IFNAME" not in os.environ:
        agent_env["GLOO_SOCKET_IFNAME"] = interface  # gloo listens where the store does, not on every interface
    hosts_store = plan.node_rank == 0 if plan.rdzv_backend == "static" else (plan.nnodes == 1 or plan.node_rank == 0)
    with _added_environment(agent_env), contextlib.ExitStack() as stack:
        try:
            if hosts_store:
                stack.enter_context(store_server(plan.bind_addr, plan.master_port))
            if plan.nnodes > 1:
                failed = _network_check(plan, options)
                if failed is not None or options.check_network:
                    return failed or 0
            run(args)
        except ChildFailedError as exc:
            return _report_failure(exc, options.quiet)
        except SignalException as exc:
            print(f"hasten launch: stopped by signal {exc.sigval.name}; all workers were terminated.",
                  file=sys.stderr)
            return 128 + int(exc.sigval)
        except (RendezvousError, DistStoreError, DistNetworkError) as exc:  # static rendezvous: its store timed out
            print(f"hasten launch: the machines could not meet at {plan.master_addr}:{plan.master_port} "
                  f"({type(exc).__name__}: {exc}). HINT: check --main_process_ip/--main_process_port, that every "
                  "machine uses the same values and --num_machines, and that the port is reachable.",
                  file=sys.stderr)
            return 1
        except LaunchError as exc:
            print(f"hasten launch: error: {exc}", file=sys.stderr)
            return 2
    return 0


def _network_check(plan: LaunchPlan, options: LaunchOptions) -> int | None:
    """Multi-machine launches: check the network before the rendezvous; the exit code if it failed, else None."""
    from hasten.launchers.netcheck import NetworkCheckFailed, check_network, describe, rendezvous_timeout

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
