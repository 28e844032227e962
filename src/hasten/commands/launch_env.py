"""Accelerate's launcher helpers that other tools (and Accelerate's own tests) call, built from hasten's launch
configuration instead of refused: ``_validate_launch_command`` (``accelerate.commands.launch``),
``prepare_simple_launcher_cmd_env``, ``prepare_multi_gpu_env`` and ``_convert_nargs_to_dict``
(``accelerate.utils.launch``).

They return what Accelerate's return: the launch namespace completed from the configuration file, the
worker command, the environment a worker would get (``os.environ`` plus the ``ACCELERATE_*`` / ``FSDP_*``
variables ``hasten launch`` exports, with ``HASTEN_LAUNCH_CONFIG``). The configuration is the one
``hasten launch`` would run (file, then flags, validated; :func:`hasten.commands.launch.resolve_config`).
"""

from __future__ import annotations

import argparse
import os
import sys
from ast import literal_eval
from typing import Any

#: Where :func:`_validate_launch_command` leaves the resolved configuration for the ``prepare_*`` helpers.
_RESOLVED = "_hasten_launch_config"
_PLATFORM_FLAGS = {"FSDP": "use_fsdp", "DEEPSPEED": "use_deepspeed", "MEGATRON_LM": "use_megatron_lm"}


def _resolved_config(args: argparse.Namespace) -> Any:
    """The launch configuration of ``args`` (file, then flags), with its process count decided."""
    config = getattr(args, _RESOLVED, None)
    if config is None:
        from hasten.commands.launch import resolve_config
        from hasten.launchers.plan import local_device_count, resolve_processes

        config = resolve_processes(resolve_config(args, os.environ), local_device_count(os.environ))
        config.validate("the launch settings")
    return config


def _validate_launch_command(args: argparse.Namespace) -> tuple[argparse.Namespace, Any, bool]:
    """Complete a parsed ``launch_command_parser()`` namespace from the configuration file, as Accelerate does.

    Returns:
        ``(args, defaults, mp_from_config_flag)``: ``args`` with every option the file sets filled in and the
        platform flags (``use_fsdp``, ``multi_gpu``, ``use_cpu``...) decided; the file's ``ClusterConfig``
        (``None`` without a file); whether ``mixed_precision`` came from the file.

    Raises:
        ConfigurationError: the settings are invalid (what ``hasten launch`` would refuse).
    """
    from hasten.commands.config.config_args import load_config_from_file
    from hasten.config.io import find_config_file

    path = find_config_file(args.config_file, os.environ)
    defaults = load_config_from_file(str(path)) if path is not None else None
    mp_from_config_flag = getattr(args, "mixed_precision", None) is None and defaults is not None
    config = _resolved_config(args)
    data = config.to_launch_dict()
    for key, value in data.items():
        if isinstance(value, dict):  # fsdp_config: the launcher's fsdp_* options
            for inner, inner_value in value.items():
                if getattr(args, inner, None) is None and inner_value is not None:
                    setattr(args, inner, inner_value)
        elif getattr(args, key, None) is None and value is not None:
            setattr(args, key, value)
    distributed = str(data.get("distributed_type") or "NO")
    for kind, flag in _PLATFORM_FLAGS.items():
        setattr(args, flag, distributed == kind)
    args.use_cpu = args.cpu = bool(data.get("use_cpu"))
    args.multi_gpu = distributed.startswith("MULTI_") and not args.use_cpu
    args.mixed_precision = str(data.get("mixed_precision") or "no")
    args.dynamo_backend = str(getattr(args, "dynamo_backend", None) or "no")
    args.num_machines = int(data.get("num_machines") or 1)
    args.machine_rank = int(data.get("machine_rank") or 0)
    setattr(args, _RESOLVED, config)
    return args, defaults, mp_from_config_flag


def _worker_env(args: argparse.Namespace) -> dict[str, str]:
    from hasten.launchers.plan import worker_env

    config = _resolved_config(args)
    env = dict(os.environ)
    env.update(worker_env(config, getattr(args, "num_cpu_threads_per_process", None)))
    return env


def prepare_simple_launcher_cmd_env(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The command and environment of a single-process (or CPU) launch, as Accelerate returns them.

    Returns:
        ``([python, [-m,] script, *script_args], env)``: ``env`` is ``os.environ`` plus what a worker of
        ``hasten launch`` receives (the ``ACCELERATE_*`` variables among them) and, for several
        processes, ``MASTER_ADDR`` / ``MASTER_PORT``.

    Raises:
        ValueError: ``--module`` with ``--no_python`` (Accelerate's message).
    """
    if args.no_python and args.module:
        raise ValueError("--module and --no_python cannot be used together")
    command = [] if args.no_python else [sys.executable, *(["-m"] if args.module else [])]
    command += [args.training_script, *args.training_script_args]
    env = _worker_env(args)
    config = _resolved_config(args)
    if (config.num_processes or 1) > 1 or (config.num_machines or 1) > 1:
        env["MASTER_ADDR"] = config.main_process_ip or "127.0.0.1"
        env["MASTER_PORT"] = str(config.main_process_port or 29500)
    return command, env


def prepare_multi_gpu_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment of a torchrun launch, as Accelerate returns it: ``os.environ`` plus what a worker of
    ``hasten launch`` receives; ``args`` gains torchrun's ``nproc_per_node`` / ``nnodes`` / ``node_rank``.

    Raises:
        ValueError: ``--module`` with ``--no_python`` (Accelerate's message).
    """
    if args.module and args.no_python:
        raise ValueError("--module and --no_python cannot be used together")
    config = _resolved_config(args)
    machines = config.num_machines or 1
    args.nproc_per_node = str((config.num_processes or 1) // machines)
    if machines > 1:
        args.nnodes, args.node_rank = str(machines), int(config.machine_rank or 0)
    args.main_process_port = config.main_process_port or 29500
    return _worker_env(args)


def _literal(value: str) -> Any:
    """A number where ``value`` is one (``"3"`` -> 3, ``"0.5"`` -> 0.5), else ``value``."""
    try:
        number = float(value)
    except ValueError:
        return value
    return int(number) if number.is_integer() else number


def _convert_nargs_to_dict(nargs: list[str]) -> dict[str, Any]:
    """``["--epochs", "3", "--lr", "0.5", "--fast", "True"]`` -> ``{"epochs": 3, "lr": 0.5, "fast": True}``.

    Raises:
        ValueError: an option without a value (a ``store_true`` flag), as Accelerate refuses it.
    """
    parser = argparse.ArgumentParser()
    for index, item in enumerate(nargs):
        if not item.startswith("-"):
            continue
        if index + 1 >= len(nargs) or nargs[index + 1].startswith("-"):
            raise ValueError("SageMaker doesn’t support argparse actions for `store_true` or `store_false`. Please "
                             f"define explicit types (the option {item} has no value).")
        parser.add_argument(item, type=_literal)
    return {key: literal_eval(value) if value in ("True", "False") else value
            for key, value in vars(parser.parse_args(nargs)).items()}
