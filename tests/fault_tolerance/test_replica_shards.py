"""What crosses between replica groups when their processes shard the model (``hasten.fault_tolerance.shards``),
and the layouts inside a group that are refused at ``prepare``.

Ground truth of the round trip: a second sharded model (FSDP2, or TP) and optimizer loaded from the first one's
marked local shards hold, gathered, exactly the first one's weights and momentum (as a healed group must). No
torchft needed.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hasten import ParallelismConfig
from hasten.accelerator._fault_tolerance import check_replica_layout
from hasten.exceptions import ConfigurationError


def _sharded(seed: int, layout: str = "fsdp2") -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small model sharded over the 2 ranks: FSDP2 (every tensor Shard(0)), or TP (column-wise then row-wise:
    the second layer's bias is Replicate)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(seed + dist.get_rank())  # each rank its own start: what the loads must overwrite
    model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 2))
    if layout == "tp":
        parallelize_module(model, init_device_mesh("cpu", (2,)), {"0": ColwiseParallel(), "2": RowwiseParallel()},
                           src_data_rank=None)
    else:
        fully_shard(model)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def _heal_one_model_from_another(layout: str) -> dict[str, bool]:
    from torch.distributed.tensor import DTensor

    from hasten.fault_tolerance.shards import (
        LOCAL_SHARD,
        model_state_from_local,
        optimizer_state_from_local,
        to_local_state,
    )

    live, live_optimizer = _sharded(0, layout)
    for p in live.parameters():
        p.grad = torch.ones_like(p)  # one step: the momentum buffers exist (DTensors, as the parameters)
    live_optimizer.step()
    healing, healing_optimizer = _sharded(10, layout)  # another start, and no optimizer state yet
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
@pytest.mark.parametrize("layout", ["fsdp2", "tp"])
def test_local_shards_rebuild_a_sharded_model_and_its_optimizer_state(layout: str) -> None:
    result = _heal_one_model_from_another(layout)  # on each of 2 gloo ranks
    assert result == {"plain": True, "weights": True, "momentum": True, "sharded": True, "refused": True}


@pytest.mark.world_size(2)
def test_align_replicated_gives_every_rank_the_first_ranks_copy_and_leaves_shards_alone() -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from hasten.fault_tolerance.shards import align_replicated

    model, _ = _sharded(0, "tp")  # each rank started from other weights
    plain = torch.full((3,), float(dist.get_rank()))
    shards = {name: value.to_local().clone() for name, value in model.state_dict().items()
              if not value.placements[0].is_replicate()}
    align_replicated([plain, *model.state_dict().values()])
    assert plain.tolist() == [0.0, 0.0, 0.0]
    bias = model.state_dict()["2.bias"]
    assert isinstance(bias, DTensor) and bias.placements[0].is_replicate()
    copies = [torch.empty_like(bias.to_local()) for _ in range(2)]
    dist.all_gather(copies, bias.to_local().contiguous())
    assert torch.equal(copies[0], copies[1])  # the Replicate bias is one copy again
    for name, before in shards.items():  # Shard placements untouched
        assert torch.equal(model.state_dict()[name].to_local(), before)


def test_layouts_replica_groups_cannot_serve_are_refused_with_the_reason() -> None:
    with pytest.raises(ConfigurationError, match="does not work with DeepSpeed"):
        check_replica_layout("DEEPSPEED", None)
    with pytest.raises(ConfigurationError, match=r"pipeline parallel inside a group \(pp_size=2\)"):
        check_replica_layout("FSDP", ParallelismConfig(pp_size=2))
    check_replica_layout("FSDP", ParallelismConfig(dp_shard_size=2, tp_size=2))  # FSDP2 x TP: served
    check_replica_layout("MULTI_CPU", None)  # DDP inside a group
