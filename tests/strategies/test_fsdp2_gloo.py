"""FSDP2's gloo settings: the in-place reduce-scatter equals gloo's own, the prefetch plan follows forward order.

End to end, every FSDP2 / HSDP / TP row of the strategy contract test trains through both settings on gloo
and must equal one process (a reduce-scatter that hands a rank the wrong slice fails 8 of those rows).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hasten.strategies.fsdp2_gloo import InPlaceAllReduceScatter, _prefetch_in_forward_order, uses_gloo
from hasten.testing.distributed import run_on_ranks


def _reduce_scatter_both_ways() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    assert uses_gloo(torch.device("cpu"))
    results = {}
    for name, op in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG), ("max", dist.ReduceOp.MAX)):
        gen = torch.Generator().manual_seed(rank)
        source = torch.randn(world * 5, generator=gen)
        expected = torch.empty(5)
        dist.reduce_scatter_tensor(expected, source.clone(), op=op)
        comm = InPlaceAllReduceScatter()
        buffer = comm.allocate((world * 5,), dtype=torch.float32, device=torch.device("cpu"))
        buffer.copy_(source)
        got = comm.allocate((5,), dtype=torch.float32, device=torch.device("cpu"))
        comm(output_tensor=got, input_tensor=buffer, group=dist.group.WORLD, op=op)
        results[name] = (expected, got)
    return results


def test_in_place_reduce_scatter_equals_gloo_reduce_scatter() -> None:
    for rank_results in run_on_ranks(_reduce_scatter_both_ways, world_size=2):
        for name, (expected, got) in rank_results.items():
            assert torch.equal(got, expected), name  # bitwise: gloo's own reduce-scatter all-reduces too


class _Unit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.prefetch: list[nn.Module] | None = None

    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        self.prefetch = modules

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class _OutOfOrder(nn.Module):
    """Registers a, b, c but runs c, a, b (and a twice), as a model with a late-registered embedding would."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = _Unit(), _Unit(), _Unit()
        self.swap = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swap:
            return self.a(self.b(self.c(x)))
        return self.b(self.a(self.a(self.c(x))))


def test_prefetch_plan_follows_the_first_forward_and_its_hooks_go() -> None:
    model = _OutOfOrder()
    _prefetch_in_forward_order(model, [model.a, model.b, model.c])
    model(torch.randn(1, 2))
    assert model.c.prefetch == [model.a] and model.a.prefetch == [model.b] and model.b.prefetch is None
    model.swap = True  # a later forward in another order changes nothing: the plan was made once
    model(torch.randn(1, 2))
    assert model.c.prefetch == [model.a] and model.a.prefetch == [model.b] and model.b.prefetch is None
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
