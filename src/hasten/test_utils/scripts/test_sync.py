"""Distributed checks of gradient synchronisation: ``no_sync``, ``accumulate`` and the end of the data
(Accelerate's ``test_sync.py`` name).

The ground truth is one process training the same model on the whole global batch: with replicated
data parallelism, every synced step must leave each rank's model equal to it, and inside ``no_sync`` the
ranks' gradients must be their own shard's. Run with
``hasten launch --num_processes 2 hasten/test_utils/scripts/test_sync.py``.
"""

from __future__ import annotations

import contextlib
from copy import deepcopy
from typing import Any

import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader

from hasten.accelerator import Accelerator, DataLoaderConfiguration
from hasten.state import AcceleratorState, GradientState
from hasten.test_utils.training import RegressionDataset, RegressionModel
from hasten.utils import DistributedType, gather, set_seed

BATCH = 16  # global batch: every rank gets BATCH // num_processes rows


def get_training_setup(accelerator: Accelerator, sched: bool = False) -> tuple[Any, ...]:
    """A baseline model on the full data (one process's view) and a prepared copy with a sharded loader."""
    set_seed(42)
    model = RegressionModel()
    baseline = deepcopy(model)
    data = RegressionDataset(length=80, seed=42)
    loader = DataLoader(data, batch_size=BATCH)
    baseline.to(accelerator.device)
    if not sched:
        return baseline, accelerator.prepare(model), accelerator.prepare(loader)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    base_opt = torch.optim.SGD(baseline.parameters(), lr=0.1)
    sched_fn = LambdaLR(opt, lr_lambda=lambda epoch: epoch**0.65)
    base_sched = LambdaLR(base_opt, lr_lambda=lambda epoch: epoch**0.65)
    model, opt, sched_fn, loader = accelerator.prepare(model, opt, sched_fn, loader)
    return baseline, base_opt, base_sched, model, opt, sched_fn, loader


def step_model(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, accelerator: Accelerator | None,
               scale: float = 1.0) -> None:
    """One forward/backward of the mean squared error, ``scale``-d (for manual accumulation)."""
    loss = F.mse_loss(model(x), y.to(x.device))
    if accelerator is None:
        (loss * scale).backward()
    else:
        accelerator.backward(loss)


def check_model_parameters(model_a: torch.nn.Module, model_b: torch.nn.Module, should_match: bool,
                           step: int) -> None:
    """The two models' gradients are equal (``should_match``) or differ, at ``step``."""
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        if not a.requires_grad:
            continue
        assert a.grad is not None and b.grad is not None, f"step {step}: no gradient"
        same = torch.allclose(a.grad, b.grad, atol=1e-6)
        assert same == should_match, (f"step {step}: gradients {'differ' if should_match else 'match'} "
                                      f"({a.grad} vs {b.grad}), expected the opposite")


def _global_batch(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return gather((batch["x"], batch["y"]))  # type: ignore[return-value]


def test_noop_sync(accelerator: Accelerator) -> None:
    """One process: ``no_sync`` changes nothing, gradients equal the baseline's at every step."""
    baseline, model, loader = get_training_setup(accelerator)
    for step, batch in enumerate(loader):
        x, y = _global_batch(batch)
        step_model(baseline, x, y, None)
        with accelerator.no_sync(model) if step % 2 == 0 else contextlib.nullcontext():
            step_model(model, batch["x"], batch["y"], accelerator)
        check_model_parameters(baseline, model, True, step)
        baseline.zero_grad()
        model.zero_grad()


def test_distributed_sync(accelerator: Accelerator) -> None:
    """Several processes: inside ``no_sync`` the ranks keep their own gradients (which differ from the
    global batch's); a synced step averages them to the global batch's gradient."""
    baseline, model, loader = get_training_setup(accelerator)
    for step, batch in enumerate(loader):
        x, y = _global_batch(batch)
        step_model(baseline, x, y, None)
        if step % 2 == 0:
            with accelerator.no_sync(model):
                step_model(model, batch["x"], batch["y"], accelerator)
            check_model_parameters(baseline, model, False, step)
        else:
            step_model(model, batch["x"], batch["y"], accelerator)
            check_model_parameters(baseline, model, True, step)
        baseline.zero_grad()
        model.zero_grad()


def test_gradient_accumulation(split_batches: bool = False) -> None:
    """``accumulate`` with 2 steps equals manual accumulation of half-weighted losses on the global batch,
    gradients synchronised only on every second batch and on the last one."""
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(gradient_accumulation_steps=2,
                              dataloader_config=DataLoaderConfiguration(split_batches=split_batches))
    baseline, model, loader = get_training_setup(accelerator)
    batches = len(loader)
    for step, batch in enumerate(loader):
        x, y = _global_batch(batch)
        step_model(baseline, x, y, None, scale=0.5)
        with accelerator.accumulate(model):
            step_model(model, batch["x"], batch["y"], accelerator)
        synced = (step + 1) % 2 == 0 or step == batches - 1
        assert accelerator.sync_gradients == synced, f"step {step}: sync_gradients={accelerator.sync_gradients}"
        if synced or accelerator.num_processes == 1:
            check_model_parameters(baseline, model, True, step)
        if synced:
            baseline.zero_grad()
            model.zero_grad()
    GradientState._reset_state()


def test_gradient_accumulation_with_opt_and_scheduler(split_batches: bool = False) -> None:
    """With an optimizer and a scheduler, every synced step moves the prepared model exactly as the
    baseline, and the scheduler steps once per synced step (``num_processes`` times without
    ``split_batches``, as in Accelerate)."""
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(gradient_accumulation_steps=2,
                              dataloader_config=DataLoaderConfiguration(split_batches=split_batches))
    baseline, base_opt, base_sched, model, opt, sched, loader = get_training_setup(accelerator, sched=True)
    batches = len(loader)
    for step, batch in enumerate(loader):
        x, y = _global_batch(batch)
        step_model(baseline, x, y, None, scale=0.5)
        with accelerator.accumulate(model):
            step_model(model, batch["x"], batch["y"], accelerator)
            opt.step()
            sched.step()
            opt.zero_grad()
        if (step + 1) % 2 == 0 or step == batches - 1:
            base_opt.step()
            # Accelerate's rule: without split_batches each process saw 1/n of the step's samples, so
            # the prepared scheduler advances n times per optimizer step
            for _ in range(1 if split_batches else accelerator.num_processes):
                base_sched.step()
            base_opt.zero_grad()
        for a, b in zip(baseline.parameters(), accelerator.unwrap_model(model).parameters()):
            assert torch.allclose(a, b, atol=1e-6), f"step {step}: parameters {a} vs {b}"
        assert opt.param_groups[0]["lr"] == base_opt.param_groups[0]["lr"], (
            f"step {step}: lr {opt.param_groups[0]['lr']} vs {base_opt.param_groups[0]['lr']}")
    GradientState._reset_state()


def test_dataloader_break() -> None:
    """``GradientState`` follows the active loader, nested loaders included, and says when it ends."""
    AcceleratorState._reset_state(True)
    accelerator = Accelerator()
    batch_size = max(4 // accelerator.num_processes, 1)
    eight: Any = list(range(8))
    twelve: Any = list(range(12))
    first = accelerator.prepare(DataLoader(eight, batch_size=batch_size))
    second = accelerator.prepare(DataLoader(twelve, batch_size=batch_size))
    assert accelerator.gradient_state.active_dataloader is None
    for i, _ in enumerate(first):
        assert id(accelerator.gradient_state.active_dataloader) == id(first)
        if i < len(first) - 1:
            assert not accelerator.gradient_state.end_of_dataloader
            for j, _ in enumerate(second):
                assert id(accelerator.gradient_state.active_dataloader) == id(second)
                assert accelerator.gradient_state.end_of_dataloader == (j == len(second) - 1)
        else:
            assert accelerator.gradient_state.end_of_dataloader
    assert accelerator.gradient_state.active_dataloader is None


def main() -> None:
    accelerator = Accelerator()
    state = accelerator.state
    if state.distributed_type == DistributedType.NO or state.num_processes == 1:
        state.print("**Test `no_sync` context manager (one process)**")
        test_noop_sync(accelerator)
    else:
        state.print("**Test distributed `no_sync` context manager**")
        test_distributed_sync(accelerator)
    for split_batches in (False, True):
        state.print(f"**Test `accumulate` gradient accumulation, split_batches={split_batches}**")
        test_gradient_accumulation(split_batches)
        state.print(f"**Test `accumulate` with optimizer and scheduler, split_batches={split_batches}**")
        test_gradient_accumulation_with_opt_and_scheduler(split_batches)
    state.print("**Test `accumulate` gradient accumulation with dataloader break**")
    test_dataloader_break()
    accelerator.print("All synchronisation checks passed.")


if __name__ == "__main__":
    main()
