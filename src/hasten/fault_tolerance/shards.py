"""Sharded replicas (FSDP2 / tensor parallel inside each replica group): what crosses between the groups.

Rank ``i`` of every replica group holds the same shard of every parameter (the groups have the same layout), and
torchft connects the groups' rank ``i`` (its managed process group, and its healing checkpoint fetched by group
rank). So the cross-group gradient average and the healing transfer both work on each rank's *local* tensors:
:func:`local_shard` for the gradients; :func:`to_local_state` turns a state dict's DTensors into marked local
tensors for torchft's checkpoint transport (which knows nothing of device meshes), and the two ``load_*``
functions turn them back into DTensors laid out like this process's own.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

#: Marks a DTensor's local shard inside a state sent to a healing peer.
LOCAL_SHARD = "__hasten_local_shard__"


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: a DTensor's local tensor (a view of its storage), else ``tensor`` itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def to_local_state(state: Any) -> Any:
    """``state`` (nested dicts/lists) with every DTensor replaced by its marked local shard (no copy)."""
    if isinstance(state, DTensor):
        return {LOCAL_SHARD: state.to_local()}
    if isinstance(state, dict):
        return {key: to_local_state(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(to_local_state(value) for value in state)
    return state


def _is_shard(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {LOCAL_SHARD}


def _like(local: torch.Tensor, layout: torch.Tensor) -> DTensor:
    """``local`` as a DTensor laid out as ``layout`` (same mesh, placements, global shape and stride)."""
    if not isinstance(layout, DTensor) or tuple(local.shape) != tuple(layout.to_local().shape):
        held = tuple(layout.to_local().shape) if isinstance(layout, DTensor) else "an unsharded tensor"
        raise RuntimeError(f"a healing peer sent a shard of shape {tuple(local.shape)} where this process holds "
                           f"{held}: the replica groups must have the same layout "
                           "(processes per group, sharding, parallelism sizes).")
    return DTensor.from_local(local.to(layout.device), layout.device_mesh, layout.placements, run_check=False,
                              shape=layout.shape, stride=layout.stride())


def model_state_from_local(saved: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """A model state dict from :func:`to_local_state`'s output, its shards laid out as ``own`` (the module's)."""
    return {key: _like(value[LOCAL_SHARD], own[key]) if _is_shard(value) else value for key, value in saved.items()}


def optimizer_state_from_local(saved: dict[str, Any], params: Iterable[torch.Tensor]) -> dict[str, Any]:
    """An optimizer state dict from :func:`to_local_state`'s output, each parameter's state laid out as it.

    The state's keys are the parameters' positions over the param groups (``Optimizer.state_dict``'s numbering).
    """
    by_index = dict(enumerate(params))
    state = {index: {key: _like(value[LOCAL_SHARD], by_index[int(index)]) if _is_shard(value) else value
                     for key, value in entries.items()}
             for index, entries in saved["state"].items()}
    return {**saved, "state": state}


def align_replicated(tensors: Iterable[torch.Tensor]) -> None:
    """Give every rank of this replica group the first rank's copy of each tensor the group replicates.

    Plain tensors (DDP's parameters, modules left out of the sharding) are broadcast from the group's rank 0; a
    DTensor from the first coordinate of each of its ``Replicate`` mesh dimensions; sharded dimensions are left
    alone. A collective over the group: every rank passes the same tensors in the same order.
    """
    import torch.distributed as dist

    grouped = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    with torch.no_grad():
        for tensor in tensors:
            if isinstance(tensor, DTensor):
                if any(placement.is_replicate() for placement in tensor.placements):
                    first = DTensor.from_local(tensor.to_local(), tensor.device_mesh, tensor.placements,
                                               run_check=True, shape=tensor.shape, stride=tensor.stride())
                    tensor.to_local().copy_(first.to_local())
            elif grouped:
                dist.broadcast(tensor, src=0)


__all__ = ["LOCAL_SHARD", "align_replicated", "local_shard", "model_state_from_local", "optimizer_state_from_local", "to_local_state"]
