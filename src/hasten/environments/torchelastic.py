"""torchrun / torch.distributed.run (and ``hasten launch``, which uses it)."""

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


class TorchElasticEnvironment(ClusterEnvironment):
    """Processes started by torchrun: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and friends are set."""

    name = "torchelastic"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))

    def process_info(self, env: Mapping[str, str]) -> ProcessInfo:
        src = "torchrun environment"
        world = read_int(env, "WORLD_SIZE", src)
        info = ProcessInfo(
            rank=read_int(env, "RANK", src),
            local_rank=read_int(env, "LOCAL_RANK", src),
            world_size=world,
            local_world_size=read_int(env, "LOCAL_WORLD_SIZE", src, default=world),
            node_rank=read_int(env, "GROUP_RANK", src, default=0),
            master_addr=env.get("MASTER_ADDR") or DEFAULT_MASTER_ADDR,
            master_port=read_int(env, "MASTER_PORT", src, default=DEFAULT_MASTER_PORT),
        )
        return check_ranks(info, src)
