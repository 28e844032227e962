"""What crosses between replica groups when their processes shard the model (``hasten.fault_tolerance.shards``),
and the layouts inside a group that are refused at ``prepare``.

Ground truth of the round trip: a second FSDP2 model and optimizer loaded from the first one's marked local shards
hold, gathered, exactly the first one's weights and momentum (as a healed group must). No torchft needed.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hasten import ParallelismConfig
from hasten.accelerator._fault_tolerance import check_replica_layout
from hasten.exceptions import ConfigurationError


def _sharded(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 2))
    fully_shard(model)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def _heal_one_fsdp2_model_from_another() -> dict[str, bool]:
    from torch.distributed.tensor import DTensor

    from hasten.fault_tolerance.shards import (
        LOCAL_SHARD,
        model_state_from_local,
        optimizer_state_from_local,
        to_local_state,
    )

    live, live_optimizer = _sharded(0)
    for p in live.parameters():
        p.grad = torch.ones_like(p)  # one step: the momentum buffers exist (DTensors, as the parameters)
    live_optimizer.step()
    healing, healing_optimizer = _sharded(1)  # another start, and no optimizer state yet
    sent_model, sent_optimizer = to_local_state(live.state_dict()), to_local_state(live_optimizer.state_dict())
    shards = [v[LOCAL_SHARD] for v in sent_model.values()]
    healing.load_state_dict(model_state_from_local(sent_model, healing.state_dict()))
    healing_optimizer.load_state_dict(optimizer_state_from_local(sent_optimizer, list(healing.parameters())))
    weights = all(torch.equal(_full(a), _full(b)) for a, b in zip(live.state_dict().values(),
                                                                  healing.state_dict().values()))
    momentum = all(torch.equal(_full(live_optimizer.state[a]["momentum_buffer"]),
                               _full(healing_optimizer.state[b]["momentum_buffer"]))
                   for a, b in zip(live.parameters(), healing.parameters()))
    still_sharded = all(isinstance(p, DTensor) for p in healing.parameters()) and all(
        isinstance(healing_optimizer.state[p]["momentum_buffer"], DTensor) for p in healing.parameters())
    refused = False
    wrong = {key: ({LOCAL_SHARD: torch.zeros(7)} if key == "0.weight" else value) for key, value in sent_model.items()}
    try:
        model_state_from_local(wrong, healing.state_dict())
    except RuntimeError as exc:
        refused = "same layout" in str(exc)
    return {"plain": not any(isinstance(s, DTensor) for s in shards), "weights": weights, "momentum": momentum,
            "sharded": still_sharded, "refused": refused}


@pytest.mark.world_size(2)
def test_local_shards_rebuild_an_fsdp2_model_and_its_optimizer_state() -> None:
    result = _heal_one_fsdp2_model_from_another()  # on each of 2 gloo ranks
    assert result == {"plain": True, "weights": True, "momentum": True, "sharded": True, "refused": True}


def test_layouts_replica_groups_cannot_serve_are_refused_with_the_reason() -> None:
    with pytest.raises(ConfigurationError, match="does not work with DeepSpeed"):
        check_replica_layout("DEEPSPEED", None)
    with pytest.raises(ConfigurationError, match=r"pipeline parallel inside a group \(pp_size=2\)"):
        check_replica_layout("FSDP", ParallelismConfig(pp_size=2))
    check_replica_layout("FSDP", ParallelismConfig(dp_shard_size=2, tp_size=2))  # FSDP2 x TP: served
    check_replica_layout("MULTI_CPU", None)  # DDP inside a group
