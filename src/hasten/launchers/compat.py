"""Accelerate's ``PrepareForLaunch`` and ``test_launch``, for code that starts processes itself."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from hasten.config.env import launch_config_to_env


class PrepareForLaunch:
    """Wrap ``launcher`` so that ``torch.multiprocessing.start_processes`` can run it as rank ``index``.

    Each started process gets torchrun's variables (``LOCAL_RANK``, ``RANK``...) from its index, and
    hasten's launch settings (``distributed_type``, ``debug``), before ``launcher(*args)`` runs.

    Example:
        >>> import torch.multiprocessing as mp
        >>> mp.start_processes(PrepareForLaunch(train, "MULTI_CPU"), args=(lr,), nprocs=2,
        ...                    start_method="fork")  # doctest: +SKIP
    """

    def __init__(self, launcher: Callable[..., Any], distributed_type: str = "NO", debug: bool = False) -> None:
        self.launcher = launcher
        self.distributed_type = str(getattr(distributed_type, "value", distributed_type))
        self.debug = debug

    def __call__(self, index: int, *args: Any) -> Any:
        if self.debug:
            world = int(os.environ.get("WORLD_SIZE", "1"))
            os.environ.update(LOCAL_RANK=str(index), RANK=str(index), WORLD_SIZE=str(world))
            os.environ.setdefault("LOCAL_WORLD_SIZE", str(world))
        elif self.distributed_type != "NO":
            nproc = int(os.environ.get("NPROC", os.environ.get("LOCAL_WORLD_SIZE", "1")))
            node_rank = int(os.environ.get("NODE_RANK", "0"))
            os.environ.update(LOCAL_RANK=str(index), LOCAL_WORLD_SIZE=str(nproc), RANK=str(nproc * node_rank + index))
        os.environ.update(launch_config_to_env({"distributed_type": self.distributed_type,
                                                "debug": bool(self.debug)}))
        return self.launcher(*args)


def test_launch() -> None:
    """Check that a ``PartialState`` can be set up in this process (what ``notebook_launcher`` needs)."""
    from hasten.state import PartialState

    PartialState()
