"""Turn a resolved ``LaunchConfig`` into a launch plan: which launcher, how many processes, which
rendezvous, the worker command and the variables the workers receive. Starts nothing.

Workers get torchrun's standard variables, ``HASTEN_LAUNCH_CONFIG`` (the JSON of the configuration, with
Accelerate's key names), Accelerate's ``ACCELERATE_*`` variables, and what keeps a launch's listeners on its
address and tells the workers where to leave preemption markers: every one of them is in the plan, so
``--dry_run`` prints all that a worker receives besides torchrun's own.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shlex
import socket
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hasten.config.env import COLLECTIVE_TIMEOUT_VAR, PREEMPTION_DIR_VAR, launch_config_to_env
from hasten.config.parallelism import parallelism_config_from_launch
from hasten.config.schema import LaunchConfig
from hasten.exceptions import ConfigurationError, LaunchError
from hasten.launchers.affinity import check_affinity_supported

DEFAULT_PORT = 29500
#: Worker group restarts allowed by default with ``--num_machines MIN:MAX`` (each machine lost uses one).
ELASTIC_RESTARTS = 3
#: A worker's exit status when hasten's hang watchdog stopped it (``hasten.runtime.watchdog.HANG_EXIT_CODE``;
#: repeated here so that planning a launch does not import torch).
HANG_EXIT_CODE = 124
# Engines whose hasten support is detected by the presence of their module (no import needed).
_ENGINE_MODULES = {"FSDP": ("hasten.strategies.fsdp2", "FSDP2"),
                   "DEEPSPEED": ("hasten.config.plugins.deepspeed", "DeepSpeed")}
# NCCL's flight recorder (torch's own): the last collectives of every rank, dumped to
# /tmp/nccl_trace_rank_<rank> when a collective times out. Complements hasten's watchdog on GPUs.
NCCL_FLIGHT_RECORDER = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
_NOT_AVAILABLE = {"XLA": "TPU (XLA) launches", "MEGATRON_LM": "Megatron-LM launches"}


@dataclass
class LaunchOptions:
    """Settings of one ``hasten launch`` run that are not part of the configuration file."""

    script: str
    script_args: list[str] = field(default_factory=list)
    module: bool = False
    no_python: bool = False
    num_cpu_threads_per_process: int | None = None
    rdzv_conf: str = ""
    #: None: 0, or ELASTIC_RESTARTS with ``--num_machines MIN:MAX`` (machines that leave use restarts)
    max_restarts: int | None = None
    monitor_interval: float = 0.1
    role: str = "default"
    tee: str = "0"
    log_dir: str | None = None
    use_mpi: bool = False
    quiet: bool = False
    collective_timeout: float | None = None
    #: run only the network check of a multi-machine launch (``--check_network``), no workers
    check_network: bool = False
    #: seconds the agent waits for workers stopping on a signal before SIGKILL (torchrun's ``--shutdown_timeout``)
    preemption_grace: float | None = None
    #: ``--replica_groups``: an existing Lighthouse (``host:port``); None: the launcher starts one
    lighthouse: str | None = None
    #: ``--replica_groups``: the timeouts (``hasten.fault_tolerance.FaultToleranceConfig``); None: the defaults
    fault_tolerance: Any = None
    #: ``--replica_groups``: restarts of lost groups before the others go on without them (None: 3)
    group_restarts: int | None = None


@dataclass
class LaunchPlan:
    """What ``hasten launch`` will do; ``describe()`` is the ``--dry_run`` output."""

    launcher: str  # "process", "torchrun", "mpirun", "slurm-task" or "replica-groups"
    config: LaunchConfig
    command: list[str]
    env: dict[str, str]
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_PORT
    rdzv_backend: str = "static"
    rdzv_conf: str = ""
    notes: list[str] = field(default_factory=list)
    mesh: str | None = None
    #: the local address the launcher and workers listen on (decided at launch: loopback on one machine)
    bind_addr: str = ""
    #: ``--num_machines MIN:MAX``: the fewest machines the run goes on with (``nnodes`` is MAX); None: fixed
    min_nnodes: int | None = None
    #: worker group restarts before the launch gives up (torchrun's ``--max_restarts``)
    max_restarts: int = 0

    @property
    def num_processes(self) -> int:
        return self.nproc_per_node * self.nnodes

    def describe(self) -> str:
        """A human-readable plan: processes, rendezvous, worker environment, command."""
        if self.launcher == "slurm-task":
            shape = "one per SLURM task"
        else:
            machines = f"{self.min_nnodes}..{self.nnodes}" if self.min_nnodes else str(self.nnodes)
            shape = (f"{self.nproc_per_node} per machine x {machines} machine{'s' if self.nnodes > 1 else ''}, "
                     f"this is machine {self.node_rank}")
        count = f"{self.nproc_per_node * self.min_nnodes}..{self.num_processes}" if self.min_nnodes else \
            str(self.num_processes)
        lines = [f"launcher:      {self.launcher}", f"processes:     {count} ({shape})"]
        if self.launcher == "torchrun":
            lines.append(f"rendezvous:    {self.rdzv_backend} at {self.master_addr}:{self.master_port}"
                         + (f" ({self.rdzv_conf})" if self.rdzv_conf else ""))
        lines.append("worker environment (besides torchrun's RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...):")
        lines.extend(f"  {key}={value}" for key, value in sorted(self.env.items()))
        if self.mesh is not None:
            lines.append(f"device mesh:   {self.mesh}")
        lines.append(f"command:       {shlex.join(self.command)}")
        lines.extend(f"note:          {note}" for note in self.notes)
        return "\n".join(lines)


def worker_env(config: LaunchConfig, num_threads: int | None = None) -> dict[str, str]:
    """The variables every worker receives on top of the launcher's own (``HASTEN_LAUNCH_CONFIG``, ...)."""
    env = launch_config_to_env(config.to_launch_dict())
    if num_threads is not None:
        env["OMP_NUM_THREADS"] = str(num_threads)
    if config.gpu_ids not in (None, "all") and not config.use_cpu:
        env["CUDA_VISIBLE_DEVICES"] = str(config.gpu_ids)
    return env


#: Python workers run through this bootstrap (see its docstring: a finished script must exit cleanly).
WORKER_MODULE = "hasten.launchers.worker"


def worker_command(options: LaunchOptions, bootstrap: bool = False) -> list[str]:
    """The command each worker runs: ``python [-m] script args`` or the script itself (``--no_python``).

    With ``bootstrap`` a Python worker runs through :mod:`hasten.launchers.worker`, which ends a
    finished script without interpreter finalization (used where a process group exists).

    Raises:
        ConfigurationError: the script does not exist, or ``--module`` with ``--no_python``.
    """
    if options.module and options.no_python:
        raise ConfigurationError("--module and --no_python cannot be used together: -m runs a Python module "
                                 "with the interpreter, --no_python runs an executable without it.")
    if options.check_network and not options.script:
        return []  # --check_network alone starts no worker
    if not options.module and not options.no_python and not Path(options.script).is_file():
        raise ConfigurationError(f"The training script {options.script!r} does not exist. HINT: check the path "
                                 "(relative to the current folder), or pass -m/--module to run a module.")
    if options.no_python:
        return [options.script, *options.script_args]
    if not bootstrap:
        return [sys.executable, *(["-m"] if options.module else []), options.script, *options.script_args]
    return [sys.executable, "-m", WORKER_MODULE, *(["--module"] if options.module else []), options.script,
            *options.script_args]


def check_engine_available(config: LaunchConfig) -> None:
    """Refuse engines hasten cannot run yet, with a clear message instead of a failure in the workers."""
    import importlib.util

    kind = config.distributed_type
    if kind in _NOT_AVAILABLE:
        raise ConfigurationError(f"distributed_type={kind}: {_NOT_AVAILABLE[kind]} are not available in hasten. "
                                 "HINT: use MULTI_GPU, MULTI_CPU, FSDP or DEEPSPEED.")
    refuse_unsupported_settings(config)
    if kind in _ENGINE_MODULES:
        module, name = _ENGINE_MODULES[kind]
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise ConfigurationError(f"distributed_type={kind}: {name} support is not available in this version "
                                     "of hasten yet. HINT: use --multi_gpu (DDP) meanwhile.")


def refuse_unsupported_settings(config: LaunchConfig) -> None:
    """Refuse settings of features hasten does not run (Megatron-LM, TPU pods), which
    Accelerate's configuration files and launch flags can carry, instead of silently ignoring them."""
    if config.megatron_lm_config:
        raise ConfigurationError(f"megatron_lm settings {sorted(config.megatron_lm_config)}: Megatron-LM is not "
                                 "available in hasten. HINT: train large models with --use_fsdp or --use_deepspeed.")
    if config.tpu_use_cluster or config.tpu_use_sudo or config.tpu_vm or config.tpu_env:
        raise ConfigurationError("TPU pod settings (--tpu_cluster, --tpu_use_sudo, --vm, --env): TPUs are not "
                                 "supported by hasten. HINT: run on CPUs or CUDA GPUs, or use Accelerate on TPUs.")
    tpu_only = {key: getattr(config, key) for key in ("tpu_name", "tpu_zone", "command_file", "commands")
                if getattr(config, key)}
    if config.downcast_bf16:
        tpu_only["downcast_bf16"] = True
    if config.main_training_function != "main":
        tpu_only["main_training_function"] = config.main_training_function
    if tpu_only:
        raise ConfigurationError(f"TPU-only settings {tpu_only}: they configure XLA/TPU launches, which hasten does "
                                 "not run, so they would have no effect. HINT: remove them (or use Accelerate on "
                                 "TPUs).")
    _refuse_deepspeed_launcher(config.deepspeed_config)


def _refuse_deepspeed_launcher(block: Mapping[str, Any]) -> None:
    """DeepSpeed's own multi-node launcher (pdsh, openmpi, ...) is not used: refuse its settings."""
    launcher = block.get("deepspeed_multinode_launcher")
    launcher_keys = {key: block[key] for key in ("deepspeed_hostfile", "deepspeed_inclusion_filter",
                                                  "deepspeed_exclusion_filter") if block.get(key) not in (None, "")}
    if launcher not in (None, "", "standard"):
        launcher_keys["deepspeed_multinode_launcher"] = launcher
    if launcher_keys:
        raise ConfigurationError(f"deepspeed_config {launcher_keys}: hasten starts DeepSpeed runs with torchrun's "
                                 "agent, one `hasten launch` per machine (Accelerate's 'standard' launcher), so "
                                 "DeepSpeed's own multi-node launcher settings would have no effect. HINT: remove "
                                 "them and run `hasten launch --machine_rank R ...` on each machine.")


def local_device_count(env: Mapping[str, str]) -> int:
    """GPUs this machine can use, without importing torch on machines that have none."""
    if not Path("/proc/driver/nvidia").exists() and not Path("/dev/kfd").exists():
        return 0
    import torch  # a GPU machine: workers import torch anyway, and only torch knows the usable count

    return int(torch.cuda.device_count())


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True when something already listens on ``host:port`` (checked by trying to bind it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host if host not in ("localhost", "") else "127.0.0.1", port))
        except OSError:
            return True
    return False


def resolve_processes(config: LaunchConfig, device_count: int) -> LaunchConfig:
    """Fill what the user left out from the hardware and derive ``distributed_type``.

    Precedence was applied before: command-line flags over the file. Here only unset values are
    filled: ``num_processes`` defaults to the GPU count per machine (1 on CPU).

    Example:
        >>> resolve_processes(LaunchConfig(use_cpu=True, num_processes=2), 0).distributed_type
        'MULTI_CPU'
    """
    use_cpu = config.use_cpu or device_count == 0
    per_node_default = 1 if use_cpu else max(device_count, 1)
    total = config.num_processes or per_node_default * config.num_machines
    if total % config.num_machines:
        raise ConfigurationError(f"num_processes={total} cannot be split evenly over num_machines="
                                 f"{config.num_machines}. HINT: num_processes is the total over all machines.")
    kind = config.distributed_type
    if kind == "NO" or kind.startswith("MULTI_"):
        kind = "NO" if total == 1 else ("MULTI_CPU" if use_cpu else
                                        (kind if kind.startswith("MULTI_") and kind != "MULTI_CPU" else "MULTI_GPU"))
    return dataclasses.replace(config, num_processes=total, distributed_type=kind)


def choose_port(config: LaunchConfig, notes: list[str]) -> int:
    """The rendezvous port: the configured one, or a free one (port 0, unset, or busy on one machine).

    Raises:
        ConfigurationError: the port is busy on the main machine of a multi-machine run.
    """
    from hasten.environments import find_free_port

    port = config.main_process_port
    single = config.num_machines == 1
    if port == 0 or (port is None and single):
        return find_free_port()
    port = DEFAULT_PORT if port is None else port
    if config.machine_rank == 0 and port_in_use(port):
        if single:
            free = find_free_port()
            notes.append(f"port {port} is in use; using free port {free} instead")
            return free
        raise ConfigurationError(f"main_process_port={port} is already in use on this machine (the main machine "
                                 "of a multi-machine run). HINT: pass --main_process_port with a free port on every "
                                 "machine, or stop the process holding it.")
    return port


def listening_variables(master_addr: str, nnodes: int, rdzv_backend: str,
                        env: Mapping[str, str]) -> tuple[str, dict[str, str]]:
    """The local address this machine's launcher and workers listen on, and the variables that keep them there.

    Raises:
        LaunchError: ``master_addr`` cannot be resolved or reached from this machine.
    """
    from hasten.environments.network import bind_address, interface_of

    address = bind_address(master_addr, nnodes)
    variables = {}
    interface = interface_of(address)
    if interface and "GLOO_SOCKET_IFNAME" not in env:
        variables["GLOO_SOCKET_IFNAME"] = interface  # gloo listens where the store does, not on every interface
    if rdzv_backend == "c10d":
        # Not the agent's shared store (torch binds it on every interface, on a port hasten cannot choose):
        # worker rank 0 hosts the process group's store, bound by hasten's worker bootstrap. It also
        # gives each restarted round a fresh store, without the dead round's keys (a dead peer's address).
        variables["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return address, variables


def preemption_folder() -> str:
    """A fresh path for the markers of workers stopped by preemption (created when the launch starts)."""
    return os.path.join(tempfile.gettempdir(), f"hasten-preempt-{secrets.token_hex(6)}")


def default_threads(config: LaunchConfig, nproc_per_node: int, requested: int | None,
                    env: Mapping[str, str]) -> int | None:
    """``OMP_NUM_THREADS`` for workers: the request, else the caller's, else cores / local processes on CPU."""
    if requested is not None:
        if requested < 1:
            raise ConfigurationError(f"--num_cpu_threads_per_process={requested} must be at least 1.")
        return requested
    if env.get("OMP_NUM_THREADS"):
        return None  # inherited by the workers as it is
    if nproc_per_node > 1 and config.use_cpu:
        return max(1, (os.cpu_count() or 1) // nproc_per_node)
    return None


def _rdzv_conf(config: LaunchConfig, requested: str) -> str:
    # With c10d every agent may think it hosts the store when all share one address; say who does.
    if config.rdzv_backend != "c10d" or config.num_machines == 1 or "is_host" in requested:
        return requested
    extra = f"is_host={'1' if config.machine_rank == 0 else '0'}"
    return f"{requested},{extra}" if requested else extra


def build_plan(config: LaunchConfig, options: LaunchOptions, env: Mapping[str, str],
               device_count: int | None = None) -> LaunchPlan:
    """Decide how to start the run: launcher, processes, rendezvous, worker command and environment.

    Args:
        config: the configuration after command-line flags were applied over the file.
        options: run settings that are not part of the file (script, restarts, ...).
        env: the launcher's environment (SLURM, Kubeflow Trainer and SkyPilot detection, ``OMP_NUM_THREADS``).
        device_count: GPUs on this machine (detected when ``None``).

    Raises:
        ConfigurationError: the settings are invalid or name an unavailable engine.
    """
    from hasten.environments import detect_machine_layout
    from hasten.launchers.clusters import apply_machine_layout
    from hasten.launchers.slurm import apply_slurm, slurm_step_info

    check_engine_available(config)
    parallelism = parallelism_config_from_launch(config.to_launch_dict())
    if parallelism is not None and config.num_processes is None:  # the mesh says how many processes
        config = dataclasses.replace(config, num_processes=parallelism.total_size)
    command = worker_command(options)
    slurm_task = False
    info = slurm_step_info(env)
    layout = None
    if info is not None and not options.use_mpi:
        config, slurm_task = apply_slurm(config, info)
    elif (layout := detect_machine_layout(env)) is not None:  # Kubeflow Trainer v2, SkyPilot
        config = apply_machine_layout(config, layout)
    config = resolve_processes(config, local_device_count(env) if device_count is None else device_count)
    config.validate("the launch settings")
    if parallelism is not None:  # refused here, before any worker starts
        parallelism.validate(config.num_processes, device_type="cpu" if config.use_cpu else None)  # type: ignore[arg-type]
    hostfile = config.mpirun_config.get("mpirun_hostfile")
    if options.use_mpi or hostfile:
        launcher = "mpirun"
    elif slurm_task:
        launcher = "slurm-task"
    elif config.num_processes > 1 or config.num_machines > 1:  # type: ignore[operator]
        launcher = "torchrun"
    else:
        launcher = "process"
    check_affinity_supported(config, options.no_python)
    if launcher in ("mpirun", "slurm-task", "process") or config.enable_cpu_affinity:
        # The bootstrap also pins cores (affinity.py) and makes `import accelerate` give hasten when the
        # real Accelerate is not installed (a Trainer script runs unchanged); torchrun's workers get it too.
        command = worker_command(options, bootstrap=True)
    notes: list[str] = []
    if layout is not None:
        notes.append(f"{layout.source}: machine {config.machine_rank} of {config.num_machines} "
                     f"({', '.join(value for _, value in layout.variables)})")
    if config.same_network and config.num_machines > 1:
        notes.append("same_network only changes TPU pod launches in Accelerate; hasten's rendezvous is the same "
                     "either way")
    if config.fp8_config and config.mixed_precision != "fp8":
        notes.append(f"fp8_config {sorted(config.fp8_config)} is used only with --mixed_precision fp8 (this run "
                     f"uses {config.mixed_precision!r})")
    nproc = config.num_processes // config.num_machines  # type: ignore[operator]
    addr = config.main_process_ip or "127.0.0.1"
    port = choose_port(config, notes) if launcher in ("torchrun", "mpirun") else (config.main_process_port or 0)
    config = dataclasses.replace(config, main_process_ip=addr, main_process_port=port or None)
    variables = worker_env(config, default_threads(config, nproc, options.num_cpu_threads_per_process, env))
    if options.collective_timeout is not None:
        variables[COLLECTIVE_TIMEOUT_VAR] = f"{options.collective_timeout:g}"
    if config.distributed_type in ("MULTI_GPU", "FSDP", "DEEPSPEED") and not config.use_cpu:
        variables.update({k: v for k, v in NCCL_FLIGHT_RECORDER.items() if k not in env})
    backend, restarts = _elastic_settings(config, options, launcher, notes)
    if launcher == "torchrun" and restarts > 0 and backend == "static":
        # torch's static rendezvous reuses the store keys of the previous round, so restarted workers can
        # read a dead peer's address; c10d rendezvous starts every round under a fresh prefix.
        if config.num_machines == 1:
            backend = "c10d"
        else:
            notes.append("--max_restarts with the static rendezvous may fail to reconnect after a restart; "
                         "use --rdzv_backend c10d on every machine")
    plan = LaunchPlan(launcher=launcher, config=config, command=command, env=variables, nproc_per_node=nproc,
                      nnodes=config.num_machines, node_rank=config.machine_rank, master_addr=addr,
                      master_port=port or DEFAULT_PORT, rdzv_backend=backend,
                      rdzv_conf=_rdzv_conf(config, options.rdzv_conf), notes=notes,
                      mesh=parallelism.describe() if parallelism is not None else None,
                      min_nnodes=config.min_machines, max_restarts=restarts)
    if launcher == "torchrun":  # decided here, not in the agent, so that --dry_run shows them
        try:
            plan.bind_addr, listening = listening_variables(addr, config.num_machines, backend, env)
        except LaunchError:  # reported when the launch starts (it binds the address again), not by --dry_run
            listening = {}
        plan.env.update(listening)
        plan.env[PREEMPTION_DIR_VAR] = preemption_folder()
    if launcher == "slurm-task":
        plan.nproc_per_node, plan.nnodes = 1, config.num_processes  # type: ignore[assignment]
        plan.node_rank = 0
    if launcher == "mpirun":
        _wrap_in_mpirun(plan, hostfile, env)
    return plan


def _elastic_settings(config: LaunchConfig, options: LaunchOptions, launcher: str,
                      notes: list[str]) -> tuple[str, int]:
    """The rendezvous backend and restart budget; ``--num_machines MIN:MAX`` needs c10d and some restarts.

    Raises:
        ConfigurationError: MIN:MAX machines with a launcher other than torchrun's agent.
    """
    restarts = options.max_restarts
    if config.min_machines is None:
        return config.rdzv_backend, restarts or 0
    if launcher != "torchrun":
        raise ConfigurationError(f"--num_machines {config.min_machines}:{config.num_machines} (machines that leave "
                                 f"or join) needs torchrun's agent, not the {launcher} launcher. HINT: run one "
                                 "`hasten launch` per machine, without --use_mpi/mpirun_hostfile or SLURM tasks.")
    if config.rdzv_backend != "c10d":
        notes.append(f"--num_machines {config.min_machines}:{config.num_machines}: using the c10d rendezvous (the "
                     "static one needs a fixed set of machines)")
    if restarts is None:
        restarts = ELASTIC_RESTARTS
        notes.append(f"--num_machines {config.min_machines}:{config.num_machines}: the worker group may restart "
                     f"{restarts} times (each machine that leaves uses one; set --max_restarts to change it)")
    return "c10d", restarts


def _wrap_in_mpirun(plan: LaunchPlan, hostfile: str | None, env: Mapping[str, str]) -> None:
    from hasten.launchers.mpirun import find_mpirun, mpi_flavour, mpirun_command

    plan.env.update(MASTER_ADDR=plan.master_addr, MASTER_PORT=str(plan.master_port))
    mpirun = find_mpirun()
    plan.command = mpirun_command(mpirun, mpi_flavour(mpirun), plan.command, plan.num_processes,
                                  plan.nproc_per_node, hostfile, plan.env, {**env, **plan.env})
