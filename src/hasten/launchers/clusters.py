"""``hasten launch`` on a machine of a Kubeflow Trainer v2 ``TrainJob`` or a SkyPilot task, with no flags.

The cluster manager's variables (read by :mod:`hasten.environments.clusters`) fill what the command line
and the configuration file left unset: the machine count and rank, the main machine's address and port,
and the processes per machine. A value given on the command line or in the file that contradicts the
cluster (``--num_machines 3`` where ``PET_NNODES=2``) is refused with one line, never half-applied.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hasten.config.schema import LaunchConfig
from hasten.environments import MachineLayout
from hasten.exceptions import ConfigurationError


def _refuse(layout: MachineLayout, key: str, given: Any, flag: str) -> ConfigurationError:
    return ConfigurationError(f"{key}={given} (command line or configuration file) contradicts this "
                              f"{layout.source} machine's {layout.variable(key)}. HINT: leave {flag} out, so that "
                              f"the {layout.source} variables decide, or fix the variable.")


def apply_machine_layout(config: LaunchConfig, layout: MachineLayout) -> LaunchConfig:
    """Fill ``config`` from the cluster's description of the machines.

    Unset values are filled: ``num_machines`` (1 in the file means unset, as Accelerate's files always write
    it), ``machine_rank``, ``main_process_ip``/``main_process_port``, and ``num_processes`` (the total:
    processes per machine x machines, when the cluster gives a per-machine count).

    Example:
        >>> layout = MachineLayout("Kubeflow Trainer", 2, 1, "pod-0", 29400, 2)
        >>> cfg = apply_machine_layout(LaunchConfig(), layout)
        >>> cfg.num_machines, cfg.machine_rank, cfg.num_processes, cfg.main_process_ip
        (2, 1, 4, 'pod-0')

    Raises:
        ConfigurationError: an explicit value contradicts the cluster.
    """
    if config.num_machines not in (1, layout.num_machines):
        raise _refuse(layout, "num_machines", config.num_machines, "--num_machines")
    if config.min_machines is not None:
        raise ConfigurationError(f"--num_machines {config.min_machines}:{config.num_machines}: machines that leave or "
                                 f"join are not part of a {layout.source} run, whose machine count is fixed "
                                 f"({layout.variable('num_machines')}). HINT: pass no --num_machines.")
    if config.machine_rank not in (0, layout.machine_rank):
        raise _refuse(layout, "machine_rank", config.machine_rank, "--machine_rank")
    total = config.num_processes
    # A GPU count (SkyPilot) says nothing about a --cpu run; Kubeflow's numProcPerNode is an instruction.
    per_machine = None if layout.processes_from_gpus and config.use_cpu else layout.processes_per_machine
    if total is None and per_machine is not None:
        total = per_machine * layout.num_machines
    elif total is not None and per_machine is not None and not layout.processes_from_gpus \
            and total != per_machine * layout.num_machines:
        raise ConfigurationError(f"num_processes={total} (command line or configuration file) contradicts this "
                                 f"{layout.source} machine's {layout.variable('processes_per_machine')} x "
                                 f"{layout.variable('num_machines')} = {per_machine * layout.num_machines} processes. "
                                 "HINT: leave --num_processes out (it is the total over all machines).")
    if layout.num_machines == 1:  # one machine: it listens on loopback as any single-machine launch does
        return dataclasses.replace(config, num_processes=total)
    return dataclasses.replace(
        config, num_machines=layout.num_machines, machine_rank=layout.machine_rank, num_processes=total,
        main_process_ip=config.main_process_ip or layout.main_process_ip,
        main_process_port=config.main_process_port if config.main_process_port is not None
        else layout.main_process_port)
