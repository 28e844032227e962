"""Accelerate's checkpoint functions ``save_accelerator_state`` / ``load_accelerator_state`` (refused
before issue 27) run as Accelerate's do."""

from __future__ import annotations

import torch
from torch import nn


def test_save_and_load_accelerator_state_round_trip(tmp_path):
    """As Accelerate's: model weights, optimizer, scheduler and this process's generators come back, and
    ``load_accelerator_state`` returns the saved step."""
    from hasten import PartialState
    from hasten.checkpointing import load_accelerator_state, save_accelerator_state

    PartialState()
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    scheduler.step()
    folder = save_accelerator_state(tmp_path, [model.state_dict()], [optimizer], [scheduler], [], 0, 7)
    assert sorted(p.name for p in folder.iterdir()) == ["model.safetensors", "optimizer.bin", "random_states_0.pkl",
                                                        "scheduler.bin"]
    expected_draw = torch.rand(3)
    other = nn.Linear(3, 2)
    other_optimizer = torch.optim.Adam(other.parameters())
    other_scheduler = torch.optim.lr_scheduler.StepLR(other_optimizer, 1)
    assert load_accelerator_state(tmp_path, [other], [other_optimizer], [other_scheduler], [], 0) == {"step": 7}
    assert torch.equal(torch.rand(3), expected_draw)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
    assert other_optimizer.state_dict()["state"][0]["step"] == 1 and other_scheduler.last_epoch == 1
