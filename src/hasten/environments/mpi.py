"""MPI launchers: OpenMPI (``OMPI_COMM_WORLD_*``), MPICH / Intel MPI (``PMI_*``) and MVAPICH (``MV2_*``).

MPI tells each process its rank but not where to meet; ``MASTER_ADDR``/``MASTER_PORT`` come from the
environment (``hasten launch`` and the user's ``mpirun -x`` set them), defaulting to the local host.
"""

from __future__ import annotations

from collections.abc import Mapping

from hasten.environments.base import (
    DEFAULT_MASTER_ADDR,
    DEFAULT_MASTER_PORT,
    ClusterEnvironment,
    ProcessInfo,
    check_ranks,
    read_int,
)


def _node_rank(rank: int, local_rank: int, local_size: int) -> int:
    # With the same number of processes on every node, rank // local_size is the node's index.
    return rank // local_size if local_size > 0 else 0


class _MPIBase(ClusterEnvironment):
    prefix_rank: str
    prefix_size: str
    prefix_local_rank: str
    prefix_local_size: str

    @classmethod
    def _detect(cls, env: Mapping[str, str]) -> bool:
        return cls.prefix_size in env and cls.prefix_rank in env

    def process_info(self, env: Mapping[str, str]) -> ProcessInfo:
        src = f"{self.name} environment"
        rank = read_int(env, self.prefix_rank, src)
        world = read_int(env, self.prefix_size, src)
        local_rank = read_int(env, self.prefix_local_rank, src, default=rank)
        local_size = read_int(env, self.prefix_local_size, src, default=world)
        info = ProcessInfo(
            rank=rank,
            local_rank=local_rank,
            world_size=world,
            local_world_size=local_size,
            node_rank=_node_rank(rank, local_rank, local_size),
            master_addr=env.get("MASTER_ADDR") or DEFAULT_MASTER_ADDR,
            master_port=read_int(env, "MASTER_PORT", src, default=DEFAULT_MASTER_PORT),
        )
        return check_ranks(info, src)


class OpenMPIEnvironment(_MPIBase):
    """OpenMPI's ``mpirun``."""

    name = "openmpi"
    prefix_rank = "OMPI_COMM_WORLD_RANK"
    prefix_size = "OMPI_COMM_WORLD_SIZE"
    prefix_local_rank = "OMPI_COMM_WORLD_LOCAL_RANK"
    prefix_local_size = "OMPI_COMM_WORLD_LOCAL_SIZE"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return OpenMPIEnvironment._detect(env)


class MPICHEnvironment(_MPIBase):
    """MPICH and Intel MPI (the PMI process manager); local ranks from ``MPI_LOCALRANKID``."""

    name = "mpich"
    prefix_rank = "PMI_RANK"
    prefix_size = "PMI_SIZE"
    prefix_local_rank = "MPI_LOCALRANKID"
    prefix_local_size = "MPI_LOCALNRANKS"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return MPICHEnvironment._detect(env)


class MVAPICHEnvironment(_MPIBase):
    """MVAPICH2's ``mpirun_rsh``."""

    name = "mvapich"
    prefix_rank = "MV2_COMM_WORLD_RANK"
    prefix_size = "MV2_COMM_WORLD_SIZE"
    prefix_local_rank = "MV2_COMM_WORLD_LOCAL_RANK"
    prefix_local_size = "MV2_COMM_WORLD_LOCAL_SIZE"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return MVAPICHEnvironment._detect(env)
