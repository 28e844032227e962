"""Kubeflow PyTorchJob: one process per pod, ``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` set, no ``LOCAL_RANK``."""

from __future__ import annotations

from collections.abc import Mapping

from hasten.environments.base import ClusterEnvironment, ProcessInfo, check_ranks, read_int


class KubeflowEnvironment(ClusterEnvironment):
    """Pods of a PyTorchJob, each running one process."""

    name = "kubeflow"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        keys = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        return all(k in env for k in keys) and "LOCAL_RANK" not in env

    def process_info(self, env: Mapping[str, str]) -> ProcessInfo:
        src = "Kubeflow environment"
        rank = read_int(env, "RANK", src)
        info = ProcessInfo(rank=rank, local_rank=0, world_size=read_int(env, "WORLD_SIZE", src),
                           local_world_size=1, node_rank=rank, master_addr=env["MASTER_ADDR"],
                           master_port=read_int(env, "MASTER_PORT", src))
        return check_ranks(info, src)
