"""A plain single process (``python script.py``, a notebook, a test)."""

from __future__ import annotations

import socket
from collections.abc import Mapping

from hasten.environments.base import DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT, ClusterEnvironment, ProcessInfo


class LocalEnvironment(ClusterEnvironment):
    """One process and no peers."""

    name = "local"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return True

    def process_info(self, env: Mapping[str, str]) -> ProcessInfo:
        return ProcessInfo(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0,
                           master_addr=env.get("MASTER_ADDR") or DEFAULT_MASTER_ADDR,
                           master_port=int(env.get("MASTER_PORT") or DEFAULT_MASTER_PORT))


def find_free_port(host: str = "127.0.0.1") -> int:
    """Ask the OS for a free TCP port on ``host`` (the caller should use it promptly)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
