"""Who am I and who are my peers: pure functions of an environment mapping."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from hasten.exceptions import ConfigurationError

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class ProcessInfo:
    """Where this process sits in the run.

    Example:
        >>> ProcessInfo(rank=1, local_rank=1, world_size=2, local_world_size=2, node_rank=0,
        ...             master_addr="127.0.0.1", master_port=29500)
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def torch_env(self) -> dict[str, str]:
        """The ``env://`` variables that ``torch.distributed.init_process_group`` reads."""
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


class ClusterEnvironment(ABC):
    """One way processes are told their place (torchrun, MPI, SLURM, ...)."""

    name: ClassVar[str]

    @staticmethod
    @abstractmethod
    def detect(env: Mapping[str, str]) -> bool:
        """True when ``env`` was written by this launcher or scheduler."""

    @abstractmethod
    def process_info(self, env: Mapping[str, str]) -> ProcessInfo:
        """Read this process's place from ``env``."""


def read_int(env: Mapping[str, str], key: str, source: str, default: int | None = None) -> int:
    """Parse an integer variable, naming it and its source when it is missing or malformed."""
    raw = env.get(key)
    if raw is None or raw == "":
        if default is None:
            raise ConfigurationError(f"{source}: environment variable {key} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigurationError(f"{source}: environment variable {key}={raw!r} is not an integer") from None


def check_ranks(info: ProcessInfo, source: str) -> ProcessInfo:
    """Validate rank arithmetic so a bad scheduler variable fails here, not as a hang in rendezvous."""
    if info.world_size < 1:
        raise ConfigurationError(f"{source}: world size {info.world_size} must be at least 1")
    if not 0 <= info.rank < info.world_size:
        raise ConfigurationError(f"{source}: rank {info.rank} is outside 0..{info.world_size - 1}")
    if not 0 <= info.local_rank < max(info.local_world_size, 1):
        raise ConfigurationError(
            f"{source}: local rank {info.local_rank} is outside 0..{info.local_world_size - 1}")
    return info


def export_torch_env(info: ProcessInfo) -> None:
    """Make MPI/SLURM ranks visible under torchrun's names (``RANK``, ...) for libraries that read them.

    Values already set (non-empty) are kept. Unless ``GLOO_SOCKET_IFNAME`` is set, gloo is pointed at the interface that
    reaches the main process (loopback on one machine) instead of the one the host name resolves to.
    """
    for key, value in info.torch_env().items():
        if not os.environ.get(key):  # unset, or exported empty (`export MASTER_ADDR=$(...)` that found nothing)
            os.environ[key] = value
    if "GLOO_SOCKET_IFNAME" not in os.environ and info.world_size > 1:
        from hasten.environments.network import gloo_interface_for

        interface = gloo_interface_for(info.master_addr, single_machine=info.local_world_size == info.world_size)
        if interface:
            os.environ["GLOO_SOCKET_IFNAME"] = interface


@dataclass(frozen=True)
class MachineLayout:
    """The machines of a run as a cluster manager describes them, for one ``hasten launch`` per machine.

    ``processes_per_machine`` is None when the cluster does not say (``hasten launch`` then starts one process
    per GPU, or one on a CPU machine, unless ``--num_processes`` says otherwise); ``processes_from_gpus`` marks
    a count that is only the machine's GPUs (SkyPilot), not an instruction (Kubeflow's ``numProcPerNode``).
    ``variables`` names the variable each value came from (``("num_machines", "PET_NNODES=2")``, ...) for
    messages.

    Example:
        >>> MachineLayout("SkyPilot", 2, 1, "10.0.0.1", None, None).num_machines
        2
    """

    source: str
    num_machines: int
    machine_rank: int
    main_process_ip: str
    main_process_port: int | None
    processes_per_machine: int | None
    variables: tuple[tuple[str, str], ...] = ()
    processes_from_gpus: bool = False

    def variable(self, key: str) -> str:
        """``NAME=value`` of the variable that gave ``key`` (the source's name when none did)."""
        return dict(self.variables).get(key, self.source)


def read_port(env: Mapping[str, str], key: str, source: str) -> int | None:
    """A TCP port variable (None when unset), refused when it is not an integer in 1..65535."""
    raw = env.get(key, "").strip()
    if not raw:
        return None
    hint = "HINT: set it to a port in 1..65535 that is free on the main machine."
    try:
        port = int(raw)
    except ValueError:
        raise ConfigurationError(f"{source}: {key}={raw!r} is not an integer. {hint}") from None
    if not 1 <= port <= 65535:
        raise ConfigurationError(f"{source}: {key}={raw!r} is not a TCP port. {hint}")
    return port
