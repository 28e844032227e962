"""``find_executable_batch_size(..., plan=...)``: the first size tried is the memory plan's largest fitting
batch size; a real out-of-memory error still reduces it as without a plan.

Ground truth: ``plan_largest_batch_size`` with the same plan (itself checked against brute force in
test_memory_plan), and the decorator's own reduction rule (``int(size * 0.9)``, as Accelerate's).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hasten.memory_plan import BatchSizePlan, PlanError, plan_largest_batch_size, plan_memory


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 128))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _budget() -> int:
    return plan_memory(_Net, batch_size=100, input_shape=(128,), device_type="cpu").peak_bytes


def _plan(budget: int | str | None = None) -> BatchSizePlan:
    return BatchSizePlan(_Net, budget or _budget(), input_shape=(128,), device_type="cpu")


def test_starts_at_the_plans_largest_fitting_batch_size_and_still_reduces_on_oom():
    from hasten import find_executable_batch_size

    plan = _plan()
    expected = plan_largest_batch_size(_Net, plan.budget_bytes, batch_size=4096, input_shape=(128,),
                                       device_type="cpu")
    assert 100 <= expected < 4096
    tried = []

    @find_executable_batch_size(starting_batch_size=4096, plan=plan)
    def train(batch_size):
        tried.append(batch_size)
        if len(tried) == 1:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return batch_size

    assert train() == int(expected * 0.9)
    assert tried == [expected, int(expected * 0.9)]
    assert train() == int(expected * 0.9) and len(tried) == 3  # later calls keep the size that worked, no replan


def test_the_plan_never_starts_above_starting_batch_size_and_says_when_nothing_fits():
    from hasten import find_executable_batch_size

    tried = []
    find_executable_batch_size(lambda batch_size: tried.append(batch_size), starting_batch_size=8, plan=_plan())()
    assert tried == [8]
    with pytest.raises(PlanError, match="'lots' is not a size"):
        _plan("lots")
    with pytest.raises(RuntimeError, match="not even a batch of one"):
        find_executable_batch_size(lambda batch_size: None, plan=_plan(1024))()


LINEAR = "torch.nn:Linear"
LINEAR_PLAN = {"model_kwargs": {"in_features": 256, "out_features": 256}, "input_shape": (256,), "device_type": "cpu"}


def _first_size_inside_a_run(budget: int) -> int:
    from hasten import find_executable_batch_size

    tried = []
    find_executable_batch_size(lambda batch_size: tried.append(batch_size), starting_batch_size=4096,
                               plan=BatchSizePlan(LINEAR, budget, **LINEAR_PLAN))()
    return tried[0]


def test_inside_a_running_process_group_the_plan_runs_in_a_fresh_interpreter():
    from hasten.testing import run_on_ranks

    budget = plan_memory(LINEAR, batch_size=300, **LINEAR_PLAN).peak_bytes
    expected = plan_largest_batch_size(LINEAR, budget, batch_size=4096, **LINEAR_PLAN)
    assert 300 <= expected < 4096
    assert run_on_ranks(_first_size_inside_a_run, world_size=2, args=(budget,), timeout=300) == [expected, expected]
