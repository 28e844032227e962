"""Cluster managers that describe machines rather than processes: Kubeflow Trainer v2 and SkyPilot.

Both start one container or shell per machine and tell it, through variables, how many machines there are,
which one it is and where the first one is. ``hasten launch`` (with no flags) turns that into a
multi-machine launch (:meth:`machine_layout`); a script started directly on each machine, one process
per machine, finds its place from the same variables (:meth:`process_info`).

* Kubeflow Trainer v2 (``TrainJob``) sets ``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``,
  ``PET_MASTER_ADDR`` and ``PET_MASTER_PORT`` (the names torchrun reads its flags from).
* SkyPilot sets ``SKYPILOT_NODE_IPS`` (one address per line, the first is the head node),
  ``SKYPILOT_NUM_NODES``, ``SKYPILOT_NODE_RANK`` and ``SKYPILOT_NUM_GPUS_PER_NODE``. It gives no port:
  ``MASTER_PORT`` if set, else hasten's default (29500). With no GPUs, one process per machine unless
  ``hasten launch --num_processes`` (the total over all machines) says otherwise.

Inconsistent values are refused with one line naming the variable, its value and the fix, never run as
a world of one process.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from hasten.environments.base import (
    DEFAULT_MASTER_PORT,
    ClusterEnvironment,
    MachineLayout,
    ProcessInfo,
    check_ranks,
    read_port,
)
from hasten.exceptions import ConfigurationError


def _count(env: Mapping[str, str], key: str, source: str, hint: str, low: int = 1) -> int:
    """An integer variable of at least ``low``; refused with ``hint`` when missing or malformed."""
    raw = env.get(key, "").strip()
    if not raw:
        raise ConfigurationError(f"{source}: {key} is not set. HINT: {hint}")
    try:
        value = int(raw)
    except ValueError:
        raise ConfigurationError(f"{source}: {key}={raw!r} is not an integer. HINT: {hint}") from None
    if value < low:
        raise ConfigurationError(f"{source}: {key}={raw!r} must be at least {low}. HINT: {hint}")
    return value


def _machine_rank(env: Mapping[str, str], key: str, count_key: str, count: int, source: str) -> int:
    rank = _count(env, key, source, f"number the machines 0..{count - 1}.", low=0)
    if rank >= count:
        raise ConfigurationError(f"{source}: {key}={env[key].strip()!r} is not below {count_key}={count}: machine "
                                 f"ranks run from 0 to {count - 1}. HINT: fix {key} or {count_key} so that every "
                                 "machine has its own rank below the machine count.")
    return rank


def _one_process_per_machine(layout: MachineLayout, why: str) -> ProcessInfo:
    """This process as the only one on its machine (a script started directly on each machine)."""
    if layout.processes_per_machine not in (None, 1):
        raise ConfigurationError(f"{layout.source}: {why}={layout.processes_per_machine} processes per machine, but "
                                 "this process was started on its own (no RANK/LOCAL_RANK from a launcher). HINT: "
                                 "start the script with `hasten launch script.py` (or torchrun) on each machine.")
    info = ProcessInfo(rank=layout.machine_rank, local_rank=0, world_size=layout.num_machines, local_world_size=1,
                       node_rank=layout.machine_rank, master_addr=layout.main_process_ip,
                       master_port=layout.main_process_port or DEFAULT_MASTER_PORT)
    return check_ranks(info, f"{layout.source} environment")


class KubeflowTrainerEnvironment(ClusterEnvironment):
    """A pod of a Kubeflow Trainer v2 ``TrainJob`` (torch runtime): ``PET_*`` describe the machines."""

    name = "kubeflow-trainer"
    source = "Kubeflow Trainer"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        # PyTorchJob (Trainer v1) with an elastic policy sets PET_NNODES too, but never PET_NODE_RANK.
        return "PET_NNODES" in env and "PET_NODE_RANK" in env

    def machine_layout(self, env: Mapping[str, str]) -> MachineLayout:
        """The machines of the ``TrainJob``.

        Raises:
            ConfigurationError: a missing, malformed or inconsistent ``PET_*`` variable (named).
        """
        src = self.source
        nnodes = _count(env, "PET_NNODES", src, "set the TrainJob's spec.trainer.numNodes to the number of pods "
                        "(a fixed count; hasten does not read MIN:MAX from it).")
        rank = _machine_rank(env, "PET_NODE_RANK", "PET_NNODES", nnodes, src)
        addr = env.get("PET_MASTER_ADDR", "").strip()
        if not addr:
            raise ConfigurationError(f"{src}: PET_MASTER_ADDR is not set. HINT: set it to the address of the pod "
                                     "with PET_NODE_RANK=0 (the torch runtime sets it to that pod's DNS name).")
        nproc = self._nproc(env)
        port = read_port(env, "PET_MASTER_PORT", src)
        variables = (("num_machines", f"PET_NNODES={nnodes}"), ("machine_rank", f"PET_NODE_RANK={rank}"),
                     ("main_process_ip", f"PET_MASTER_ADDR={addr}"),
                     ("processes_per_machine", f"PET_NPROC_PER_NODE={env.get('PET_NPROC_PER_NODE', '')}"),
                     *((("main_process_port", f"PET_MASTER_PORT={port}"),) if port else ()))
        return MachineLayout(src, nnodes, rank, addr, port, nproc, variables)

    def _nproc(self, env: Mapping[str, str]) -> int | None:
        raw = env.get("PET_NPROC_PER_NODE", "").strip()
        if raw.lower() in ("", "auto", "gpu"):
            return None  # torchrun's "one per GPU" (hasten: one per GPU, or one on a CPU machine)
        return _count(env, "PET_NPROC_PER_NODE", self.source, "set the TrainJob's numProcPerNode to the number of "
                      "processes per pod (an integer, or 'auto' for one per GPU).")

    def process_info(self, env: Mapping[str, str]) -> ProcessInfo:
        return _one_process_per_machine(self.machine_layout(env), "PET_NPROC_PER_NODE")


class SkyPilotEnvironment(ClusterEnvironment):
    """A node of a SkyPilot task: ``SKYPILOT_*`` describe the nodes; the first address is the head node."""

    name = "skypilot"
    source = "SkyPilot"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return "SKYPILOT_NODE_RANK" in env and ("SKYPILOT_NUM_NODES" in env or "SKYPILOT_NODE_IPS" in env)

    def machine_layout(self, env: Mapping[str, str]) -> MachineLayout:
        """The nodes of the task.

        Raises:
            ConfigurationError: a missing, malformed or inconsistent ``SKYPILOT_*`` variable (named).
        """
        src = self.source
        ips = [line.strip() for line in env.get("SKYPILOT_NODE_IPS", "").splitlines() if line.strip()]
        if env.get("SKYPILOT_NUM_NODES", "").strip() or not ips:
            nodes = _count(env, "SKYPILOT_NUM_NODES", src, "set it to the task's num_nodes (SkyPilot does).")
        else:
            nodes = len(ips)
        if ips and len(ips) != nodes:
            raise ConfigurationError(f"{src}: SKYPILOT_NODE_IPS lists {len(ips)} address{'es' if len(ips) != 1 else ''} "
                                     f"({', '.join(ips)}) but SKYPILOT_NUM_NODES={nodes}. HINT: list one address per "
                                     "node, one per line, the head node first.")
        if not ips and nodes > 1:
            raise ConfigurationError(f"{src}: SKYPILOT_NODE_IPS is not set but SKYPILOT_NUM_NODES={nodes}. HINT: set "
                                     "it to the nodes' addresses, one per line, the head node first.")
        rank = _machine_rank(env, "SKYPILOT_NODE_RANK", "SKYPILOT_NUM_NODES", nodes, src)
        gpus = self._gpus(env)
        main_ip = ips[0] if ips else "127.0.0.1"
        port = read_port(env, "MASTER_PORT", src)
        variables = (("num_machines", f"SKYPILOT_NUM_NODES={nodes}"), ("machine_rank", f"SKYPILOT_NODE_RANK={rank}"),
                     ("main_process_ip", f"SKYPILOT_NODE_IPS (first line {main_ip})"),
                     ("processes_per_machine", f"SKYPILOT_NUM_GPUS_PER_NODE={gpus}"),
                     *((("main_process_port", f"MASTER_PORT={port}"),) if port else ()))
        return MachineLayout(src, nodes, rank, main_ip, port, gpus or None, variables, processes_from_gpus=True)

    def _gpus(self, env: Mapping[str, str]) -> int:
        raw = env.get("SKYPILOT_NUM_GPUS_PER_NODE", "").strip() or "0"
        try:
            gpus = float(raw)  # a fractional accelerator (T4:0.5) still runs one process on it
        except ValueError:
            gpus = -1.0
        if not 0 <= gpus < 1 << 20:  # nan fails too
            raise ConfigurationError(f"{self.source}: SKYPILOT_NUM_GPUS_PER_NODE={raw!r} is not a number of GPUs. "
                                     "HINT: set it to the GPUs of each node (0 on CPU nodes).")
        return math.ceil(gpus)

    def process_info(self, env: Mapping[str, str]) -> ProcessInfo:
        # SkyPilot runs the task's `run` commands once per node: a script started there is one process per node.
        layout = dataclasses.replace(self.machine_layout(env), processes_per_machine=None)
        return _one_process_per_machine(layout, "SKYPILOT_NUM_GPUS_PER_NODE")


#: The cluster managers that describe machines, in the order they are tried.
MACHINE_ENVIRONMENTS: tuple[type[KubeflowTrainerEnvironment | SkyPilotEnvironment], ...] = (
    KubeflowTrainerEnvironment, SkyPilotEnvironment)


def detect_machine_layout(env: Mapping[str, str]) -> MachineLayout | None:
    """The machines described by a cluster manager's variables in ``env`` (None when there are none).

    Example:
        >>> detect_machine_layout({"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "pod-0",
        ...                        "PET_NPROC_PER_NODE": "2"}).num_machines
        2

    Raises:
        ConfigurationError: the variables are present but inconsistent.
    """
    for cls in MACHINE_ENVIRONMENTS:
        if cls.detect(env):
            return cls().machine_layout(env)
    return None
