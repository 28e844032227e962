"""``notebook_launcher`` and ``debug_launcher``: start a training *function* on several forked processes.

Differences from Accelerate, same signatures:

* ``num_processes=None`` uses every visible GPU (one process on a CPU-only machine) instead of raising;
* a busy ``use_port`` on a single machine is replaced by a free port instead of failing;
* the launcher refuses to fork, with the fix in the message, when CUDA or a process group or a
  ``PartialState`` already exists in the parent (the cause of "Cannot re-initialize CUDA in forked
  subprocess" and of hangs);
* a failing rank raises ``LaunchError`` carrying that rank's traceback;
* ``debug_launcher`` needs no port: its ranks meet at a file store in a temporary folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hasten._accelerate_alias import install_unless_real_accelerate
from hasten.base.environment import patch_environment
from hasten.config.env import launch_config_to_env
from hasten.config.schema import LaunchConfig
from hasten.exceptions import ConfigurationError, LaunchError
from hasten.launchers.plan import LaunchPlan, choose_port, listening_variables, worker_env

_PRECISIONS = ("no", "fp16", "bf16", "fp8")


def _refuse_unsafe_fork() -> None:
    import torch
    import torch.distributed as dist

    from hasten.state import PartialState

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        raise ConfigurationError(
            "CUDA was already initialized in this notebook/process, so forked processes cannot use it "
            "('Cannot re-initialize CUDA in forked subprocess'). HINT: restart the kernel and make sure no cell "
            "touches the GPU (model.cuda(), torch.cuda.*, creating an Accelerator) before notebook_launcher; do "
            "that inside the training function instead.")
    if dist.is_available() and dist.is_initialized():
        raise ConfigurationError("A torch.distributed process group already exists in this process. HINT: restart "
                                 "the kernel and create the Accelerator/PartialState only inside the function.")
    if PartialState._shared_state:
        raise ConfigurationError(
            "A PartialState/Accelerator was already created in this notebook, so the launched processes would "
            "inherit it. HINT: restart the kernel and create the Accelerator only inside the training function.")


def _end_process_group() -> None:
    from hasten.runtime.process_group import end_group

    end_group(barrier=True)  # gloo may abort a rank whose peer tears down first


def _rank_main(function: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap the user's function: run it, then end the process group (forked ranks skip atexit)."""
    @functools.wraps(function)  # the agent logs the entry point's name and qualname
    def run(*args: Any) -> Any:
        install_unless_real_accelerate()  # libraries the function imports (transformers...) find hasten
        from hasten.launchers.machines.store import bind_worker_store

        store = bind_worker_store(os.environ)  # noqa: F841 - c10d on one machine: rank 0 hosts on loopback
        result = function(*args)
        _end_process_group()
        return result
    return run


def _launch_plan(config: LaunchConfig, nproc_per_node: int, num_nodes: int, node_rank: int, master_addr: str,
                 use_port: str | int, rdzv_backend: str, rdzv_endpoint: str, max_restarts: int) -> LaunchPlan:
    """The launch plan of a function, decided as ``hasten launch`` decides a script's (:mod:`hasten.launchers.plan`).

    The port (a busy one on a single machine is replaced by a free one), the address the launcher and
    the workers listen on (loopback on one machine, unless an endpoint is given), and every variable the
    forked ranks receive besides torchrun's own.
    """
    notes: list[str] = []
    placed = dataclasses.replace(config, num_machines=num_nodes, machine_rank=node_rank,
                                 main_process_port=int(use_port))
    port = choose_port(placed, notes)
    for note in notes:
        print(f"notebook_launcher: {note}.", file=sys.stderr)
    variables = {**worker_env(config), "MASTER_ADDR": master_addr, "MASTER_PORT": str(port)}
    bind_addr = ""
    if num_nodes == 1 and not rdzv_endpoint:  # one machine: every listener on loopback, as `hasten launch`
        bind_addr, listening = listening_variables(master_addr, 1, rdzv_backend, os.environ)
        variables.update(listening, MASTER_ADDR=bind_addr)
    return LaunchPlan(launcher="torchrun", config=config, command=[], env=variables, nproc_per_node=nproc_per_node,
                      nnodes=num_nodes, node_rank=node_rank, master_addr=master_addr, master_port=port,
                      rdzv_backend=rdzv_backend, notes=notes, bind_addr=bind_addr, max_restarts=max_restarts)


def _peer_error(text: str) -> bool:
    # A rank whose peer died fails with a gloo/NCCL connection error: a symptom, not the cause.
    return "by peer" in text or "Connection closed" in text


def _root_cause_first(reports: list[str]) -> str:
    return "\n".join(sorted(reports, key=_peer_error))


def _failure_message(exc: Any) -> str:
    reports = []
    for rank, failure in sorted(exc.failures.items()):
        data = failure.error_file_data.get("message", {}) if isinstance(failure.error_file_data, dict) else {}
        stack = data.get("extraInfo", {}).get("py_callstack") if isinstance(data, dict) else None
        reports.append(f"--- rank {rank} (exit code {failure.exitcode}) ---\n{stack or failure.message}")
    return _root_cause_first(reports)


def notebook_launcher(function: Callable[..., Any], args: tuple[Any, ...] = (), num_processes: int | None = None,
                      mixed_precision: str = "no", use_port: str = "29500", master_addr: str = "127.0.0.1",
                      node_rank: int = 0, num_nodes: int = 1, rdzv_backend: str = "static", rdzv_endpoint: str = "",
                      rdzv_conf: dict[str, Any] | None = None, rdzv_id: str = "none", max_restarts: int = 0,
                      monitor_interval: float = 0.1, log_line_prefix_template: str | None = None) -> None:
    """Run ``function(*args)`` on ``num_processes`` forked processes per machine (torchrun's elastic agent).

    Args:
        function: the training function; create the ``Accelerator`` inside it.
        args: positional arguments for ``function``.
        num_processes: processes on this machine (default: the GPU count, 1 on CPU).
        mixed_precision: ``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"``, passed to the ranks.
        use_port: the port where the ranks meet (a busy port on one machine is replaced).
        master_addr: the address where the ranks meet.
        node_rank: this machine's index (multi-machine runs).
        num_nodes: number of machines.
        rdzv_backend: "static" or "c10d".
        rdzv_endpoint: the c10d rendezvous endpoint.
        rdzv_conf: extra rendezvous settings.
        rdzv_id: the rendezvous id.
        max_restarts: restarts of the worker group before giving up.
        monitor_interval: seconds between worker health checks.
        log_line_prefix_template: torchrun's per-line log prefix.

    Raises:
        ConfigurationError: invalid arguments, or forking is unsafe (the message says why and the fix).
        LaunchError: a rank failed (the message holds its traceback).

    Example:
        >>> def train(lr):
        ...     from hasten import Accelerator
        ...     accelerator = Accelerator()
        >>> notebook_launcher(train, args=(0.1,), num_processes=2)  # doctest: +SKIP
    """
    if str(mixed_precision).lower() not in _PRECISIONS:
        raise ConfigurationError(f"Unknown mixed_precision mode {mixed_precision!r}: choose one of {_PRECISIONS}.")
    if not 0 <= node_rank < num_nodes:
        raise ConfigurationError(f"node_rank={node_rank} must be in 0..{num_nodes - 1} (num_nodes={num_nodes}).")
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if num_processes is None:
        num_processes = max(gpus, 1)
    if num_processes < 1:
        raise ConfigurationError(f"num_processes={num_processes} must be at least 1.")
    # Validated by the schema the workers parse it back with (a bad mixed_precision fails here, once).
    config = LaunchConfig.from_dict(
        {"mixed_precision": str(mixed_precision).lower(), "use_cpu": gpus == 0,
         "distributed_type": "NO" if num_processes * num_nodes == 1 else ("MULTI_GPU" if gpus else "MULTI_CPU")},
        source="notebook_launcher")
    if num_processes == 1 and num_nodes == 1:
        print(f"Launching training on {'one GPU' if gpus else 'CPU'}.")
        install_unless_real_accelerate()
        with patch_environment(**worker_env(config)):
            function(*args)
        return
    _refuse_unsafe_fork()
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig as ElasticLaunchConfig, elastic_launch

    plan = _launch_plan(config, num_processes, num_nodes, node_rank, master_addr, use_port, rdzv_backend,
                        rdzv_endpoint, max_restarts)
    rdzv_conf = dict(rdzv_conf or {})
    if rdzv_backend == "static":
        rdzv_conf["rank"] = node_rank
    launch = ElasticLaunchConfig(min_nodes=plan.nnodes, max_nodes=plan.nnodes, nproc_per_node=plan.nproc_per_node,
                                 run_id=rdzv_id, rdzv_endpoint=rdzv_endpoint or f"{plan.master_addr}:{plan.master_port}",
                                 rdzv_backend=plan.rdzv_backend, rdzv_configs=rdzv_conf, max_restarts=plan.max_restarts,
                                 monitor_interval=monitor_interval, start_method="fork",
                                 log_line_prefix_template=log_line_prefix_template, local_addr=plan.bind_addr or None)
    print(f"Launching training on {num_processes} {'GPU' if gpus else 'CPU'} processes.")
    # Forked ranks copy this process's environment: the plan's variables are set here for the launch.
    with patch_environment(**plan.env), contextlib.ExitStack() as stack:
        if plan.bind_addr:
            from hasten.launchers.machines.store import store_server

            stack.enter_context(store_server(plan.bind_addr, plan.master_port))
        try:
            elastic_launch(config=launch, entrypoint=_rank_main(function))(*args)
        except ChildFailedError as exc:
            raise launch_failure(f"notebook_launcher: {_failure_message(exc)}", exc.name, exc.failures) from None


@functools.cache
def _child_failed_class() -> type:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    class ChildLaunchError(LaunchError, ChildFailedError):  # type: ignore[misc]
        """A launched process failed: hasten's ``LaunchError`` that is also torch's ``ChildFailedError``
        (what Accelerate's launchers raise), so either ``except`` clause catches it."""

        def __init__(self, message: str, name: str, failures: dict[int, Any]) -> None:
            Exception.__init__(self, message)
            self.name = name
            self.failures = failures

        def __str__(self) -> str:
            return str(self.args[0])

    return ChildLaunchError


def launch_failure(message: str, name: str, failures: dict[int, Any] | None = None) -> LaunchError:
    """The error a failed ``notebook_launcher``/``debug_launcher`` raises (a ``LaunchError`` and a ``ChildFailedError``)."""
    return _child_failed_class()(message, name, dict(failures or {}))


def _debug_rank(rank: int, function: Callable[..., Any], args: tuple[Any, ...], world: int, folder: str) -> None:
    import torch.distributed as dist

    from hasten.runtime.process_group import start_group
    from hasten.state import reset_state

    reset_state()  # the rank must not reuse the parent's view of the run
    install_unless_real_accelerate()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      **launch_config_to_env({"use_cpu": True, "mixed_precision": "no",
                                              "distributed_type": "MULTI_CPU"}))
    store = dist.FileStore(os.path.join(folder, "store"), world)
    start_group(backend="gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(minutes=5))
    try:
        function(*args)
    except BaseException:
        Path(folder, f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    _end_process_group()


def debug_launcher(function: Callable[..., Any], args: tuple[Any, ...] = (), num_processes: int = 2) -> None:
    """Run ``function(*args)`` on ``num_processes`` forked CPU processes (gloo), for debugging.

    Example:
        >>> def check():
        ...     from hasten import PartialState
        ...     assert PartialState().num_processes == 2
        >>> debug_launcher(check)  # doctest: +SKIP

    Raises:
        LaunchError: a rank failed (the message holds every failed rank's traceback).
    """
    if num_processes < 1:
        raise ConfigurationError(f"num_processes={num_processes} must be at least 1.")
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="hasten-debug-") as folder:
        try:
            mp.start_processes(_debug_rank, args=(function, args, num_processes, folder), nprocs=num_processes,
                               join=True, start_method="fork")
        except Exception as exc:  # noqa: BLE001 - re-raised with every rank's own traceback
            reports = [f"--- rank {r} ---\n{p.read_text()}" for r in range(num_processes)
                       if (p := Path(folder, f"rank{r}.err")).exists()]
            raise launch_failure("debug_launcher: " + (_root_cause_first(reports) or str(exc)),
                                 getattr(function, "__name__", "function")) from None
