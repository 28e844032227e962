"""Launching inside a SLURM job step (``srun hasten launch ...``).

Two layouts are recognised from the step's environment (read through ``hasten.environments``):

* every SLURM task is one training process (``srun --ntasks=8 hasten launch train.py``): each task runs
  the script directly and ``PartialState`` reads its rank from SLURM;
* one task per machine (``srun --ntasks-per-node=1 hasten launch --num_processes 16 train.py``): each
  task starts torchrun's agent for its machine, with the machine count, machine rank and main address
  taken from SLURM unless given on the command line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from hasten.config.schema import LaunchConfig
from hasten.environments import ProcessInfo, SLURMEnvironment
from hasten.exceptions import ConfigurationError


def slurm_step_info(env: Mapping[str, str]) -> ProcessInfo | None:
    """This task's place when running as a task of a multi-task SLURM step, else ``None``."""
    if not SLURMEnvironment.detect(env):
        return None
    info = SLURMEnvironment().process_info(env)
    return info if info.world_size > 1 else None


def apply_slurm(config: LaunchConfig, info: ProcessInfo) -> tuple[LaunchConfig, bool]:
    """Fill the configuration from the SLURM step; return it and whether each task is one rank.

    Example:
        >>> info = ProcessInfo(rank=1, local_rank=1, world_size=2, local_world_size=2, node_rank=0,
        ...                    master_addr="n1", master_port=12345)
        >>> apply_slurm(LaunchConfig(), info)[1]
        True

    Raises:
        ConfigurationError: ``num_processes`` fits neither layout.
    """
    nodes = max(info.world_size // max(info.local_world_size, 1), 1)
    if config.num_processes in (None, info.world_size):
        filled = dataclasses.replace(config, num_processes=info.world_size, num_machines=nodes,
                                     machine_rank=info.node_rank, main_process_ip=info.master_addr,
                                     main_process_port=info.master_port)
        return filled, True
    if info.local_world_size == 1:
        changes: dict[str, object] = {}
        if config.num_machines == 1:
            changes["num_machines"] = info.world_size
            changes["machine_rank"] = info.rank
        if config.main_process_ip is None:
            changes["main_process_ip"] = info.master_addr
        if config.main_process_port is None:
            changes["main_process_port"] = info.master_port
        return dataclasses.replace(config, **changes), False  # type: ignore[arg-type]
    raise ConfigurationError(
        f"num_processes={config.num_processes} does not match this SLURM step ({info.world_size} tasks, "
        f"{info.local_world_size} per machine). HINT: either leave out --num_processes so that every SLURM task "
        "is one process, or start one task per machine (srun --ntasks-per-node=1 hasten launch ...).")
