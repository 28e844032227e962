"""Objects and checks shared by the checkpointing tests (``tests/checkpointing/``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from hasten import Accelerator
from hasten.checkpointing import newest_checkpoint


def prepared_model_optimizer_scheduler(**kwargs):
    """A two-layer model, AdamW and a StepLR, seeded and prepared by a new ``Accelerator(**kwargs)``."""
    accelerator = Accelerator(**kwargs)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    return (accelerator, *accelerator.prepare(model, optimizer, scheduler))


def prepared_model_optimizer(**kwargs):
    """The same two-layer model and AdamW, without a scheduler."""
    accelerator = Accelerator(**kwargs)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    return (accelerator, *accelerator.prepare(model, optimizer))


def weights_of(accelerator, model) -> dict[str, torch.Tensor]:
    """A copy of the unwrapped model's state dict."""
    return {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Whether two state dicts hold the same keys and bit-identical tensors."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class Counter:
    """A registered object holding any value (``count``)."""

    def __init__(self, count=0):
        self.count = count

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


class StepCounter:
    """The registered object of the asynchronous-save workers: the step whose weights the save holds."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def newest_checkpoint_step(project: Path, trial: str) -> int:
    """Load the newest complete checkpoint of a save-forever worker (one process) and return its step.

    The workers fill every weight with the step they save, so a checkpoint mixing two saves is caught;
    a failure names ``trial``.
    """
    newest = newest_checkpoint(project)
    assert newest is not None, f"{trial}: no complete checkpoint left"
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = accelerator.prepare(nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512)))
    accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3))
    counter = StepCounter()
    accelerator.register_for_checkpointing(counter)
    try:
        accelerator.load_state(newest)
    except Exception as exc:  # noqa: BLE001 - reported with the trial that produced it
        pytest.fail(f"{trial}: {newest} does not load: {exc}")
    for p in model.parameters():
        assert torch.equal(p, torch.full_like(p, float(counter.step))), f"{trial}: {newest} mixes saves"
    return counter.step
