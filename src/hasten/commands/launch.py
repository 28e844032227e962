"""``hasten launch [flags] script.py [script args]``: Accelerate's flags, torchrun's agent underneath.

Precedence: flags given on the command line > the configuration file (``--config_file`` or the default
file) > detection. Every flag is accepted as ``--foo_bar`` and ``--foo-bar``. Unlike
``accelerate launch``, ``--cpu --num_processes 2`` starts two processes (torchrun's agent, no MPI), and
``--cpu`` does not make the default configuration file be ignored.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from typing import Any

from hasten._lazy import accelerate_path_getattr
from hasten.config.parallelism import PP_SCHEDULES
from hasten.config.schema import DEEPSPEED_KEYS, FSDP_KEYS
from hasten.launchers.plan import ELASTIC_RESTARTS

# --dynamo_backend's choices (lower case, as typed). The module's DYNAMO_BACKENDS is Accelerate's, from
# commands.config.config_utils (upper case), resolved through hasten/_accelerate_shown.py.
_DYNAMO_BACKEND_CHOICES = ["no", "eager", "aot_eager", "inductor", "aot_ts_nvfuser", "nvprims_nvfuser",
                           "cudagraphs", "ofi", "fx2trt", "onnxrt", "tensorrt", "aot_torchxla_trace_once",
                           "torchxla_trace_once", "torhchxla_trace_once", "tvm"]  # the last-but-one spelling is Accelerate's own typo, kept
MEGATRON_LM_KEYS = ("tp_degree", "use_custom_fsdp", "no_load_optim", "eod_mask_loss", "overlap_cpu_optimizer_d2h_h2d",
                    "no_save_optim", "optimizer_cpu_offload", "use_precision_aware_optimizer",
                    "decoder_last_pipeline_num_layers", "pp_degree", "num_micro_batches", "sequence_parallelism",
                    "recompute_activations", "use_distributed_optimizer", "gradient_clipping",
                    "recompute_granularity", "recompute_method", "recompute_num_layers", "attention_backend",
                    "expert_model_parallel_size", "context_parallel_size", "attention_dropout", "hidden_dropout",
                    "attention_softmax_in_fp32", "expert_tensor_parallel_size", "calculate_per_token_loss",
                    "use_rotary_position_embeddings")
# (flag, config key or None for run options, block or None, argparse keyword arguments, help)
_STORE = {"action": "store_const", "const": True}
FLAGS: tuple[tuple[str, str | None, str | None, dict[str, Any], str], ...] = (
    ("--cpu", "use_cpu", None, _STORE, "Force the CPU even if GPUs are available."),
    ("--multi_gpu", "distributed_type=MULTI_GPU", None, _STORE, "Distributed GPU training (DDP)."),
    ("--tpu", "distributed_type=XLA", None, _STORE, "TPU training (not available in hasten)."),
    ("--use_deepspeed", "distributed_type=DEEPSPEED", None, _STORE, "Train with DeepSpeed."),
    ("--use_fsdp", "distributed_type=FSDP", None, _STORE, "Train with FSDP2 (fully_shard)."),
    ("--use_megatron_lm", "distributed_type=MEGATRON_LM", None, _STORE, "Megatron-LM (not available)."),
    ("--mixed_precision", "mixed_precision", None, {"choices": ["no", "fp16", "bf16", "fp8"]},
     "Mixed precision for the workers."),
    ("--num_processes", "num_processes", None, {"type": int}, "Total number of processes (all machines)."),
    ("--num_machines", "num_machines", None, {"metavar": "N|MIN:MAX"},
     "Number of machines, or MIN:MAX for an elastic run (c10d): machines may leave while MIN remain, and join."),
    ("--machine_rank", "machine_rank", None, {"type": int}, "Rank of this machine (0 = main)."),
    ("--main_process_ip", "main_process_ip", None, {}, "Address of the main machine."),
    ("--main_process_port", "main_process_port", None, {"type": int},
     "Port on the main machine (0 = pick a free port)."),
    ("--rdzv_backend", "rdzv_backend", None, {}, "Rendezvous backend: static (default) or c10d."),
    ("--same_network", "same_network", None, _STORE, "All machines are on one local network."),
    ("--gpu_ids", "gpu_ids", None, {}, "Comma-separated GPU ids to use on this machine, or 'all'."),
    ("--enable_cpu_affinity", "enable_cpu_affinity", None, _STORE,
     "Pin each local rank to its share of the cores (its GPU's NUMA node on GPU launches; Linux only)."),
    ("--main_training_function", "main_training_function", None, {}, "Training function name (TPU)."),
    ("--downcast_bf16", "downcast_bf16", None, _STORE, "TPU bf16 downcast (kept for compatibility)."),
    ("--debug", "debug", None, _STORE, "Check collectives across ranks (shapes) to turn hangs into errors."),
    ("--dynamo_backend", "dynamo_backend", "dynamo_config", {"type": str.lower, "choices": _DYNAMO_BACKEND_CHOICES},
     "torch.compile backend (e.g. inductor)."),
    ("--dynamo_mode", "dynamo_mode", "dynamo_config", {"choices": ["default", "reduce-overhead", "max-autotune"]},
     "torch.compile mode."),
    ("--dynamo_use_fullgraph", "dynamo_use_fullgraph", "dynamo_config", _STORE, "torch.compile fullgraph."),
    ("--dynamo_use_dynamic", "dynamo_use_dynamic", "dynamo_config", _STORE, "torch.compile dynamic shapes."),
    ("--dynamo_use_regional_compilation", "dynamo_use_regional_compilation", "dynamo_config", _STORE,
     "Compile repeated blocks once."),
    ("--mpirun_hostfile", "mpirun_hostfile", "mpirun_config", {}, "Wrap the run in mpirun with this hostfile."),
    # The fsdp_config / deepspeed_config flags come from the one table of block keys (hasten.config.schema).
    *((f"--{key.name}", key.name, "deepspeed_config", {"choices": list(key.choices)} if key.choices else {},
       key.help or f"DeepSpeed: {key.name}.") for key in DEEPSPEED_KEYS if key.flag),
    *((f"--{key.name}", key.name, "fsdp_config", {"choices": list(key.choices)} if key.choices else {},
       key.help or f"FSDP: {key.name}.") for key in FSDP_KEYS if key.flag),
    *((f"--fp8_{flag}", key, "fp8_config", kwargs, f"fp8 recipe: {key} (fp8 needs torchao and a GPU of compute "
       "capability 8.9 or newer).") for flag, key, kwargs in (
        ("backend", "backend", {"choices": ["ao", "te", "msamp"]}),
        ("use_autocast_during_eval", "use_autocast_during_eval", _STORE),
        ("margin", "margin", {"type": int}), ("interval", "interval", {"type": int}),
        ("format", "fp8_format", {"choices": ["HYBRID", "E4M3", "E5M2"]}),
        ("amax_history_len", "amax_history_length", {"type": int}),
        ("amax_compute_algo", "amax_compute_algorithm", {"choices": ["max", "most_recent"]}),
        ("override_linear_precision", "override_linear_precision", {}),
        ("opt_level", "optimization_level", {"choices": ["O1", "O2"]}),
        ("enable_fsdp_float8_all_gather", "enable_fsdp_float8_all_gather", {}),
        ("pad_inner_dim", "pad_inner_dim", {}))),
    ("--use_parallelism_config", "use_parallelism_config", None, _STORE,
     "Use the parallelism_config_* sizes (implied by any of them)."),
    *((f"--parallelism_config_{key}", f"parallelism_config_{key}", "parallelism_config",
       {"type": int} if key.endswith("size") else {"choices": choices} if choices else {}, text)
      for key, choices, text in (
        ("dp_replicate_size", None, "N-D parallelism: full replicas (DDP / HSDP's outer dimension)."),
        ("dp_shard_size", None, "N-D parallelism: processes each replica is sharded over (FSDP2)."),
        ("tp_size", None, "N-D parallelism: tensor-parallel degree."),
        ("cp_size", None, "N-D parallelism: context-parallel degree (CUDA only)."),
        ("cp_backend", ["torch"], "Context-parallel backend."),
        ("cp_comm_strategy", ["allgather", "alltoall"], "How context parallel exchanges keys/values."),
        ("pp_size", None, "Pipeline parallelism: processes in each pipeline (hasten)."),
        ("pp_schedule", list(PP_SCHEDULES), "Pipeline schedule (hasten); the interleaved and V ones run several "
         "stages per process."),
        ("pp_microbatches", None, "Pipeline micro-batches per batch, at least pp_size (hasten)."),
        ("pp_split_points", None, "Pipeline split points: comma-separated module names (hasten)."),
        ("sp_size", None, "DeepSpeed-Ulysses sequence parallelism (refused above 1: not available)."),
        ("sp_backend", ["deepspeed"], "Sequence-parallel backend (refused)."),
        ("sp_seq_length", None, "Sequence parallelism (refused)."),
        ("sp_seq_length_is_variable", None, "Sequence parallelism (refused)."),
        ("sp_attn_implementation", None, "Sequence parallelism (refused)."))),
    *((f"--megatron_lm_{key}", f"megatron_lm_{key}", "megatron_lm_config", {}, "Megatron-LM (refused).")
      for key in MEGATRON_LM_KEYS),
    ("--tpu_cluster", "tpu_use_cluster", None, _STORE, "TPU pod (refused: hasten has no TPU engine)."),
    ("--no_tpu_cluster", "tpu_use_cluster", None, {"action": "store_const", "const": False}, "Not a TPU pod."),
    ("--tpu_use_sudo", "tpu_use_sudo", None, _STORE, "TPU pod: sudo (refused)."),
    ("--vm", "tpu_vm", None, {"action": "append"}, "TPU pod VM (refused)."),
    ("--env", "tpu_env", None, {"action": "append"}, "TPU pod environment variable (refused)."),
    ("--aws_access_key_id", None, None, {}, "SageMaker (refused: hasten does not launch on SageMaker)."),
    ("--aws_secret_access_key", None, None, {}, "SageMaker (refused)."),
    ("--num_cpu_threads_per_process", None, None, {"type": int}, "OMP_NUM_THREADS of each worker."),
    ("--rdzv_conf", None, None, {"default": ""}, "Extra rendezvous settings: key=value,key2=value2."),
    ("--max_restarts", None, None, {"type": int},
     f"Restart the worker group up to N times (default 0; {ELASTIC_RESTARTS} with --num_machines MIN:MAX)."),
    ("--collective_timeout", None, None, {"type": float},
     "Seconds a rank may wait in one collective before every rank reports what it was doing and the run stops "
     "(default 300; InitProcessGroupKwargs(timeout=...) in the script takes precedence)."),
    ("--monitor_interval", None, None, {"type": float, "default": 0.1}, "Seconds between worker health checks."),
    ("--preemption_signal", "preemption_signal", None, {},
     "Signal that makes every worker stop at the same optimizer step, save a checkpoint (automatic checkpoint "
     "naming) and exit with code 75 (default TERM; USR1 for SLURM's --signal=USR1@90). See docs/preemption.md."),
    ("--preemption_grace", None, None, {"type": float},
     "Seconds the launcher waits for stopping workers (saving their checkpoint) before it kills them (default 30)."),
    ("--replica_groups", "replica_groups", None, {"type": int},
     "Per-step fault tolerance (torchft): split the processes into N replica groups, each its own rendezvous; a "
     "lost group is restarted and heals from a live one while the others train on. See docs/fault-tolerance.md."),
    ("--lighthouse", None, None, {}, "--replica_groups: address (host:port) of a running torchft Lighthouse "
     "(default: the launcher starts one)."),
    ("--step_timeout", None, None, {"type": float}, "--replica_groups: seconds a step's managed all-reduce may "
     "take (default 30); every other fault-tolerance timeout is derived from it."),
    *((f"--{name}", None, None, {"type": float}, f"--replica_groups: {text} (derived from --step_timeout; a value "
       "that breaks the order is refused at start).") for name, text in (
        ("heartbeat_timeout", "seconds without a heartbeat before the Lighthouse drops a group"),
        ("join_timeout", "seconds the Lighthouse waits for live groups to join a quorum"),
        ("quorum_timeout", "seconds a group waits for a quorum"),
        ("connect_timeout", "seconds to connect to the Lighthouse and peers"))),
    ("--group_restarts", None, None, {"type": int}, "--replica_groups: restarts of lost groups (default 3)."),
    ("--min_replicas", None, None, {"type": int}, "--replica_groups: the fewest groups a step commits with "
     "(default 1), for the Lighthouse and every group alike."),
    ("--role", None, None, {"default": "default"}, "torchrun worker role."),
    ("-t", None, None, {"dest": "tee", "default": "0"}, "torchrun --tee."),
    ("--log_dir", None, None, {}, "torchrun log folder."),
    ("--use_mpi", None, None, {"action": "store_true"}, "Wrap the run in mpirun on this machine (no hostfile)."),
    ("--check_network", None, None, {"action": "store_true"},
     "Run only the network check of a multi-machine launch (on every machine, with the same flags), start no "
     "worker. The script may be left out."),
)


def _aliases(flag: str) -> list[str]:
    if flag == "-t":
        return ["-t", "--tee"]
    dashed = flag.replace("_", "-")
    return [flag] if dashed == flag else [flag, "--" + dashed[2:]]


def build_launch_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``hasten launch``'s arguments to ``parser``."""
    parser.add_argument("--config_file", "--config-file", default=None, help="Configuration file to read.")
    parser.add_argument("-q", "--quiet", action="store_true", help="Print only the failing worker's traceback.")
    parser.add_argument("-m", "--module", action="store_true", help="Run the script as `python -m module`.")
    parser.add_argument("--no_python", "--no-python", action="store_true", help="Run the script without python.")
    parser.add_argument("--dry_run", "--dry-run", action="store_true", help="Print the plan, start nothing.")
    for flag, key, _block, kwargs, text in FLAGS:
        options = dict(kwargs)
        if key is not None:
            options["dest"] = flag.lstrip("-")  # Accelerate's attribute names (args.debug, args.num_processes)
            if options.get("action") is None and "choices" not in options:
                options.setdefault("metavar", flag.lstrip("-").upper())
        options.setdefault("default", None)
        parser.add_argument(*_aliases(flag), help=text, **options)
    parser.add_argument("training_script", nargs="?", default="",
                        help="The script (or module with -m) to run on every process.")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help="Arguments of the script.")
    return parser


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``hasten launch``."""
    parser = subparsers.add_parser("launch", help="Start a training script on one or many processes.",
                                   description=__doc__.split("\n\n")[0])
    build_launch_parser(parser)
    parser.set_defaults(func=launch_command)
    return parser


def launch_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """Accelerate's name: the ``launch`` parser, added to ``subparsers`` or standalone."""
    from hasten.commands.main import standalone_parser

    return standalone_parser(register, subparsers)


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The configuration keys the user passed explicitly, with blocks as nested dicts."""
    changes: dict[str, Any] = {}
    for flag, key, block, _kwargs, _text in FLAGS:
        if key is None:
            continue
        value = getattr(args, flag.lstrip("-"), None)
        if value is None:
            continue
        if "=" in key:
            name, _, constant = key.partition("=")
            previous = changes.get(name)
            if previous not in (None, constant):
                raise _conflict(f"--{previous.lower()}", flag)
            changes[name] = constant
        elif block is not None:
            changes.setdefault(block, {})[key] = value
        else:
            changes[key] = value
    if changes.get("use_cpu") and changes.get("distributed_type") == "MULTI_GPU":
        raise _conflict("--cpu", "--multi_gpu")
    if "num_machines" in changes:
        from hasten.config.schema import parse_machine_count

        changes["min_machines"], changes["num_machines"] = parse_machine_count(changes["num_machines"])
    return changes


def _conflict(first: str, second: str) -> Exception:
    from hasten.exceptions import ConfigurationError

    return ConfigurationError(f"{first} and {second} cannot be used together: choose one.")


def resolve_config(args: argparse.Namespace, env: Mapping[str, str]) -> Any:
    """The configuration after command-line flags were applied over the configuration file."""
    from hasten.config.io import find_config_file, is_accelerate_config, load_config_file
    from hasten.config.schema import LaunchConfig

    path = find_config_file(args.config_file, env)
    if args.config_file is None and is_accelerate_config(path, env):
        print(f"hasten launch: using Accelerate's configuration file {path} (hasten has none of its own; "
              "`hasten config` writes one)", file=sys.stderr)
    base = load_config_file(path) if path is not None else LaunchConfig()
    changes = overrides_from_args(args)
    data = base.to_launch_dict()
    for key, value in changes.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) else value
    return LaunchConfig.from_dict({k: v for k, v in data.items() if v is not None}, source="the launch settings")


def options_from_args(args: argparse.Namespace) -> Any:
    """The run options (script, restarts, ...) that are not part of the configuration file."""
    from hasten.launchers.plan import LaunchOptions

    return LaunchOptions(script=args.training_script, script_args=list(args.training_script_args),
                         module=args.module, no_python=args.no_python,
                         num_cpu_threads_per_process=args.num_cpu_threads_per_process, rdzv_conf=args.rdzv_conf,
                         max_restarts=args.max_restarts, monitor_interval=args.monitor_interval, role=args.role,
                         tee=args.tee, log_dir=args.log_dir, use_mpi=args.use_mpi, quiet=args.quiet,
                         collective_timeout=args.collective_timeout, check_network=args.check_network,
                         preemption_grace=args.preemption_grace, lighthouse=args.lighthouse,
                         fault_tolerance=_fault_tolerance(args), group_restarts=args.group_restarts)


def _fault_tolerance(args: argparse.Namespace) -> Any:
    """``--step_timeout`` and the other timeouts as a FaultToleranceConfig (None when none was given)."""
    names = ("step_timeout", "heartbeat_timeout", "join_timeout", "quorum_timeout", "connect_timeout", "min_replicas")
    given = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    if not given and not args.lighthouse:
        return None
    from hasten.fault_tolerance.timeouts import FaultToleranceConfig

    return FaultToleranceConfig(**given, lighthouse=_lighthouse_url(args.lighthouse))


def _lighthouse_url(address: str | None) -> str | None:
    return None if not address else address if "://" in address else f"http://{address}"


#: Bounds of the numeric run options, checked before anything leaves the launcher (a value like ``inf``
#: or ``1e300`` overflows in the workers' timers otherwise). ``(flag, low, high, low_inclusive)``.
_RANGES = (("max_restarts", 0, 1_000_000, True), ("collective_timeout", 0.0, 30 * 86400.0, False),
           ("monitor_interval", 0.0, 3600.0, False), ("num_cpu_threads_per_process", 1, 65536, True),
           ("preemption_grace", 0.0, 86400.0, True), ("group_restarts", 0, 1_000_000, True))


def _check_ranges(args: argparse.Namespace) -> None:
    """ConfigurationError naming the first option outside its range (non-finite numbers included)."""
    import math

    from hasten.exceptions import ConfigurationError

    for name, low, high, inclusive in _RANGES:
        value = getattr(args, name, None)
        if value is None:
            continue
        above_low = value >= low if inclusive else value > low
        if not (math.isfinite(value) and above_low and value <= high):
            unit = " of seconds" if isinstance(low, float) else ""
            bound = f"{'at least' if inclusive else 'above'} {low:g} and at most {high:g}"
            raise ConfigurationError(f"--{name}={value} must be a number{unit} {bound}.")


def launch_command(args: argparse.Namespace) -> int:
    """Run ``hasten launch``; user mistakes print one message and return 2 before anything starts."""
    import os

    from hasten.exceptions import ConfigurationError, LaunchError
    from hasten.launchers.plan import build_plan

    try:
        if not args.training_script and not args.check_network:
            raise ConfigurationError("the training script is missing: `hasten launch [flags] script.py [args]` "
                                     "(only --check_network runs without one).")
        if args.max_restarts is not None and args.max_restarts < 0:
            raise ConfigurationError(f"--max_restarts={args.max_restarts} must be 0 or more.")
        _check_ranges(args)
        if args.aws_access_key_id or args.aws_secret_access_key:
            raise ConfigurationError("--aws_access_key_id/--aws_secret_access_key are for Amazon SageMaker launches, "
                                     "which hasten does not support. HINT: run `hasten launch` on the instances.")
        requested = getattr(args, "num_processes", None)
        if requested is not None and requested < 1:
            # -1 means "not set" only in configuration files (Accelerate writes it); typed, it is a mistake.
            raise ConfigurationError(f"--num_processes={requested} must be at least 1 (the total number of "
                                     "processes over all machines). HINT: leave it out for one process per GPU, or "
                                     "one on CPU.")
        options = options_from_args(args)
        plan = build_plan(resolve_config(args, os.environ), options, os.environ)
        if plan.config.replica_groups is not None:  # checked here, before anything starts
            from hasten.launchers.replica_groups import plan_replica_groups

            plan_replica_groups(plan, options)
    except (ConfigurationError, LaunchError) as exc:
        print(f"hasten launch: error: {exc}", file=sys.stderr)
        return 2
    for note in plan.notes:
        print(f"hasten launch: {note}", file=sys.stderr)
    if args.dry_run:
        print(plan.describe())
        return 0
    if args.check_network and (plan.launcher != "torchrun" or plan.nnodes == 1):
        why = ("a single-machine launch listens on loopback only" if plan.nnodes == 1 else
               f"the {plan.launcher} launcher starts the workers itself; the check runs on launches with one "
               "`hasten launch --num_machines N` per machine")
        print(f"hasten launch: no network check to run: {why}.", file=sys.stderr)
        return 0
    return execute_plan(plan, options)


def execute_plan(plan: Any, options: Any) -> int:
    """Start the processes of ``plan`` and wait for them; return the exit code."""
    if plan.launcher == "replica-groups":
        from hasten.launchers.replica_groups import run_replica_groups

        return run_replica_groups(plan, options)
    if plan.launcher == "torchrun":
        from hasten.launchers.torchrun import run_torchrun

        return run_torchrun(plan, options)
    from hasten.exceptions import LaunchError
    from hasten.launchers.process import run_process

    try:
        return run_process(plan.command, plan.env)
    except LaunchError as exc:
        print(f"hasten launch: error: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    """``hasten-launch`` style entry point (the ``launch`` subcommand on its own)."""
    parser = build_launch_parser(argparse.ArgumentParser("hasten launch"))
    return launch_command(parser.parse_args(argv))


# Accelerate's other names of this module (its per-platform launchers...) resolve from
# hasten/_accelerate_paths.py on first use.
__getattr__ = accelerate_path_getattr(__name__, globals())
