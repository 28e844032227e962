"""Start the workers with torchrun's elastic agent, in this process (no second interpreter start-up).

The agent starts ``nproc_per_node`` workers, gives them torchrun's variables (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ...), stops the others as soon as one fails, restarts the group up to
``max_restarts`` times, and stops every worker on SIGINT/SIGTERM.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

from hasten.launchers.plan import WORKER_MODULE, LaunchOptions, LaunchPlan
from hasten.utils.environment import patch_environment


def torchrun_argv(plan: LaunchPlan, options: LaunchOptions) -> list[str]:
    """The ``torch.distributed.run`` arguments for ``plan`` (what ``torchrun`` would be given).

    Example:
        >>> torchrun_argv(plan, options)[:4]  # doctest: +SKIP
        ['--nnodes', '1', '--nproc_per_node', '2']
    """
    argv = ["--nnodes", str(plan.nnodes), "--nproc_per_node", str(plan.nproc_per_node),
            "--node_rank", str(plan.node_rank), "--master_addr", plan.master_addr,
            "--master_port", str(plan.master_port), "--rdzv_backend", plan.rdzv_backend,
            "--rdzv_endpoint", f"{plan.master_addr}:{plan.master_port}",
            "--max_restarts", str(options.max_restarts), "--monitor_interval", str(options.monitor_interval),
            "--role", options.role, "--tee", options.tee]
    if plan.rdzv_conf:
        argv += ["--rdzv_conf", plan.rdzv_conf]
    if plan.rdzv_backend != "static":
        argv += ["--rdzv_id", "hasten"]
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
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(torchrun_argv(plan, options))
    agent_env = dict(plan.env)
    if options.max_restarts > 0 and plan.rdzv_backend == "c10d":
        # Workers of a restarted round would otherwise share the agent's store with the dead round's keys
        # and may read a dead peer's address; a fresh store per round avoids that.
        agent_env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    with _added_environment(agent_env):
        try:
            run(args)
        except ChildFailedError as exc:
            return _report_failure(exc, options.quiet)
        except SignalException as exc:
            print(f"hasten launch: stopped by signal {exc.sigval.name}; all workers were terminated.",
                  file=sys.stderr)
            return 128 + int(exc.sigval)
        except RendezvousError as exc:
            print(f"hasten launch: the machines could not meet at {plan.master_addr}:{plan.master_port} "
                  f"({type(exc).__name__}: {exc}). HINT: check --main_process_ip/--main_process_port, that every "
                  "machine uses the same values and --num_machines, and that the port is reachable.",
                  file=sys.stderr)
            return 1
    return 0


def _report_failure(exc: Exception, quiet: bool) -> int:
    failures = exc.failures  # type: ignore[attr-defined]  # global rank -> ProcessFailure
    first_rank, first = exc.get_first_failure()  # type: ignore[attr-defined]
    described = []
    for rank in sorted(failures):
        code = failures[rank].exitcode
        described.append(f"rank {rank} " + (f"exited with code {code}" if code >= 0 else f"killed by signal {-code}"))
    print(f"hasten launch: {len(failures)} worker(s) failed ({'; '.join(described)}); the other workers were "
          "stopped. The tracebacks are printed above (the root cause is usually the one that is not "
          "'Connection closed by peer').", file=sys.stderr)
    if not quiet and first.error_file and os.path.isfile(first.error_file):
        print(f"rank {first_rank}: {first.message}", file=sys.stderr)
    code = first.exitcode
    return code if code > 0 else (128 - code if code < 0 else 1)
