"""A small training run that can be preempted mid-epoch and resumed: the preemption tests' workload.

Used two ways: ``tests/runtime/test_preemption.py`` runs :func:`train` on forked ranks (it executes this file's
text), and ``hasten launch`` / a SLURM batch job runs it as a script::

    hasten launch preemption_train.py PROJECT OUT [MARKER]

With ``MARKER`` the run starts fresh and, after 9 micro-batches, rank 0 creates that file and waits
(bounded) until its preemption watcher learned of a signal, which the test sends on seeing the file.
Without ``MARKER`` the run resumes from the newest automatic checkpoint in ``PROJECT``. Rank 0 saves
``(losses, end)`` to ``OUT`` with :func:`torch.save` (see :func:`train`).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator, ProjectConfiguration
from hasten.runtime.preemption import PREEMPTION, Preempted
from hasten.utils import set_seed

EPOCHS = 2


def build(project_dir: str | None, auto: bool) -> tuple[Any, ...]:
    """The accelerator and the prepared model, optimizer, loader and scheduler (seeded: every run alike)."""
    config = ProjectConfiguration(project_dir=project_dir, automatic_checkpoint_naming=auto)
    accelerator = Accelerator(gradient_accumulation_steps=2, project_config=config)
    set_seed(11)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.9)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(320, 6, generator=g)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=True)
    return (accelerator, *accelerator.prepare(model, optimizer, loader, scheduler))


def interrupt(accelerator: Accelerator, how: tuple[Any, ...]) -> None:
    """``("kill", rank, signal)``: that rank signals itself; ``("mark", path)``: rank 0 tells the test.

    With ``"mark"`` rank 0 creates ``path`` and waits (at most 60 s) until its watcher learned of the
    signal the test sends on seeing it, so the tiny steps cannot finish the run first.
    """
    if how[0] == "kill" and accelerator.process_index == how[1]:
        os.kill(os.getpid(), how[2])
    elif how[0] == "mark" and accelerator.is_main_process:
        open(how[1], "w").close()
        deadline = time.monotonic() + 60
        while not PREEMPTION.pending and time.monotonic() < deadline:
            time.sleep(0.01)


def train(project_dir: str, how: tuple[Any, ...] | None, resume: bool, auto: bool, signal_at: int) -> tuple[list[float], tuple[Any, ...]]:
    """Train (resuming first when ``resume``); interrupt as ``how`` says after ``signal_at`` micro-batches.

    Returns the losses (one per micro-batch) and how the run ended: ``("done", weights)`` or
    ``("stopped", S, steps, exit code)``.
    """
    accelerator, model, optimizer, loader, scheduler = build(project_dir, auto)
    if resume:
        accelerator.load_state(None if auto else os.path.join(project_dir, "manual"))
    losses: list[float] = []
    start_epoch = loader.state_dict()["epoch"] if resume else 0
    try:
        for _epoch in range(start_epoch, EPOCHS):
            for x, y in loader:
                with accelerator.accumulate(model):
                    loss = nn.functional.mse_loss(model(x), y)
                    accelerator.backward(loss)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                losses.append(round(loss.item(), 7))
                if how is not None and len(losses) == signal_at:
                    interrupt(accelerator, how)
                if accelerator.preemption_requested and not auto:  # the documented pattern without automatic naming
                    accelerator.save_state(os.path.join(project_dir, "manual"))
                    return losses, ("stopped", PREEMPTION.stop_step, PREEMPTION.steps, None)
    except Preempted as exc:
        return losses, ("stopped", PREEMPTION.stop_step, PREEMPTION.steps, exc.code)
    weights = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]
    return losses, ("done", weights)


if __name__ == "__main__":  # hasten launch preemption_train.py PROJECT OUT [MARKER]
    project, out = sys.argv[1], sys.argv[2]
    how = ("mark", sys.argv[3]) if len(sys.argv) > 3 else None
    result = train(project, how, how is None, True, 9)
    if int(os.environ["RANK"]) == 0:
        torch.save(result, out)
    if result[1][0] == "stopped":
        sys.exit(result[1][3])  # what Preempted carried: 0 under hasten launch, whose agent then exits with 75
