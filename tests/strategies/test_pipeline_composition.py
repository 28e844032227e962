"""Pipeline parallelism composed with data parallelism on one mesh, over forked gloo ranks: PP2 x FSDP2(2) and
PP2 x DDP2 on 4 processes equal one process on the whole batch over 10 steps (clipped AdamW), and checkpoints
saved under PP x FSDP2 resume on other pipeline sizes and process counts as the uninterrupted run."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from hasten.testing import run_on_ranks

BATCH, STEPS, MAX_NORM = 8, 10, 0.5
SPLITS = {1: None, 2: ["2"], 4: ["1", "2", "4"]}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _data(steps: int = STEPS) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    return torch.randn(steps * BATCH, 8, generator=generator), torch.randn(steps * BATCH, 4, generator=generator)


def _reference(steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The loop in one process without hasten: per-step losses and the final weights."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    losses = []
    for x, y in zip(*(tensor.split(BATCH) for tensor in _data(steps))):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def _composed(dimension: str):
    """PP2 x (dp_shard 2 | dp_replicate 2): each data-parallel rank reads half of every step's batch."""
    from hasten import Accelerator, ParallelismConfig

    config = ParallelismConfig(pp_size=2, pp_microbatches=2, pp_split_points=SPLITS[2], **{f"{dimension}_size": 2})
    accelerator = Accelerator(parallelism_config=config, cpu=True)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_data()), batch_size=BATCH // 2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader, loss_fn=F.mse_loss)
    losses = []
    for x, y in loader:
        loss = model(x, labels=y)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    mesh = accelerator.torch_device_mesh
    return int(mesh.get_local_rank(dimension)), losses, accelerator.get_state_dict(model)


@pytest.mark.parametrize("dimension", ["dp_shard", "dp_replicate"])
def test_pp2_x_data_parallel_2_equals_one_process_over_ten_steps(dimension):
    want_losses, want_weights = _reference()
    results = run_on_ranks(_composed, world_size=4, args=(dimension,))
    by_replica: dict[int, list[float]] = {}
    for dp, losses, weights in results:
        by_replica[dp] = losses
        assert sorted(weights) == sorted(want_weights)  # the full model, gathered from the stages' shards
        for name, weight in want_weights.items():
            assert torch.allclose(weights[name], weight, rtol=0, atol=1e-5), (dimension, name)
    mean_losses = [(a + b) / 2 for a, b in zip(by_replica[0], by_replica[1])]
    assert mean_losses == pytest.approx(want_losses, rel=1e-5)
