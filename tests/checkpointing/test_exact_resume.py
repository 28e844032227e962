"""Exact resume: a run interrupted mid-epoch and resumed from its checkpoint equals an uninterrupted run."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator, ProjectConfiguration
from hasten.testing import run_on_ranks
from hasten.utils import set_seed

EPOCHS, SAVE_AT = 3, (1, 3)  # save in epoch 1 after its 3rd batch (inside an accumulation window)


def _build(project_dir):
    accelerator = Accelerator(gradient_accumulation_steps=2,
                              project_config=ProjectConfiguration(project_dir=project_dir,
                                                                  automatic_checkpoint_naming=True))
    set_seed(11)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(52, 6, generator=g)
    data = TensorDataset(x, x.sum(1, keepdim=True))
    loader = DataLoader(data, batch_size=4, shuffle=True)
    return (accelerator, *accelerator.prepare(model, optimizer, loader, scheduler))


def _train(project_dir, stop_after_save, resume):
    accelerator, model, optimizer, loader, scheduler = _build(project_dir)
    if resume:
        accelerator.load_state()  # newest checkpoint; positions the loader, RNGs, step counter
    losses = []
    start_epoch = loader.state_dict()["epoch"] if resume else 0
    for epoch in range(start_epoch, EPOCHS):
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            losses.append(round(loss.item(), 7))
            position = loader.state_dict()["batches_yielded"]
            if not resume and (epoch, position) == SAVE_AT:
                accelerator.save_state()
                losses.append("saved")
                if stop_after_save:
                    return losses, None
    weights = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]
    return losses, weights


@pytest.mark.parametrize("world_size", [1, 2])
def test_resumed_run_equals_uninterrupted(tmp_path, world_size):
    full = run_on_ranks(_train, world_size=world_size, args=(str(tmp_path / "a"), False, False))
    run_on_ranks(_train, world_size=world_size, args=(str(tmp_path / "b"), True, False))
    resumed = run_on_ranks(_train, world_size=world_size, args=(str(tmp_path / "b"), False, True))
    for (full_losses, full_weights), (resumed_losses, resumed_weights) in zip(full, resumed):
        after = full_losses[full_losses.index("saved") + 1:]
        assert resumed_losses == after and len(after) > 5
        for a, b in zip(full_weights, resumed_weights):
            assert torch.equal(a, b)
