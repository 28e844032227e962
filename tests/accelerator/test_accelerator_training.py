"""The training loop under hasten: distributed runs equal a single-process run with the same seed."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from hasten import Accelerator, DataLoaderConfiguration
from hasten.testing import run_on_ranks
from hasten.utils import set_seed


class RegressionDataset(Dataset):
    def __init__(self, length=64, seed=7):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(length, 1, generator=g)
        self.y = 2.0 * self.x + 3.0 + 0.1 * torch.randn(length, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


class RegressionModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.tensor([0.5]))
        self.b = nn.Parameter(torch.tensor([-0.5]))

    def forward(self, x):
        return x * self.a + self.b


def train(batch_size, split_batches=False, epochs=3, shuffle=False, length=64):
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=split_batches))
    set_seed(42)
    model = RegressionModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(RegressionDataset(length), batch_size=batch_size, shuffle=shuffle)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for _ in range(epochs):
        for batch in loader:
            loss = nn.functional.mse_loss(model(batch["x"]), batch["y"])
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    unwrapped = accelerator.unwrap_model(model)
    return unwrapped.a.item(), unwrapped.b.item(), len(loader)


@pytest.mark.parametrize("shuffle", [False, True])
def test_two_ranks_equal_single_process(shuffle):
    single = train(16, shuffle=shuffle)
    per_rank = run_on_ranks(train, world_size=2, args=(8, False, 3, shuffle))
    split = run_on_ranks(train, world_size=2, args=(16, True, 3, shuffle))
    for a, b, steps in per_rank + split:
        assert steps == single[2] == 4
        assert a == pytest.approx(single[0], abs=1e-6) and b == pytest.approx(single[1], abs=1e-6)
    assert single[0] != 0.5  # it trained


def test_three_ranks_equal_single_process():
    # 48 samples: 3 ranks x batch 4 = one single-process batch of 12.
    def run(batch):
        return train(batch, epochs=2, length=48)
    single = train(12, epochs=2, length=48)
    for a, b, _ in run_on_ranks(run, world_size=3, args=(4,)):
        assert a == pytest.approx(single[0], abs=1e-6) and b == pytest.approx(single[1], abs=1e-6)


@pytest.mark.world_size(2)
def test_prepare_semantics():
    accelerator = Accelerator()
    model = RegressionModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    other = object()
    p_model, p_opt, p_other, p_sched = accelerator.prepare(model, optimizer, other, scheduler)
    assert isinstance(p_model, nn.parallel.DistributedDataParallel)
    assert p_other is other
    assert accelerator.prepare(p_model) is p_model  # never wrapped twice
    assert p_sched.optimizers == [p_opt]
    frozen = nn.Linear(2, 2).requires_grad_(False)
    assert not isinstance(accelerator.prepare(frozen), nn.parallel.DistributedDataParallel)
    assert not isinstance(accelerator.prepare_model(nn.Linear(2, 2), evaluation_mode=True),
                          nn.parallel.DistributedDataParallel)
    assert accelerator.unwrap_model(p_model) is model


@pytest.mark.world_size(2)
def test_scheduler_steps_num_processes_times():
    accelerator = Accelerator()
    model = RegressionModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    for _ in range(2):
        model(torch.ones(1)).sum().backward()
        optimizer.step()
        scheduler.step()
    assert scheduler.scheduler.last_epoch == 4  # 2 optimizer steps x 2 processes, as in Accelerate
    plateau_acc_opt = torch.optim.SGD(RegressionModel().parameters(), lr=1.0)
    plateau = accelerator.prepare(torch.optim.lr_scheduler.ReduceLROnPlateau(plateau_acc_opt))
    plateau.step(1.0)
    assert plateau.scheduler.last_epoch == 1  # never multiplied


def test_step_scheduler_with_optimizer_false():
    accelerator = Accelerator(step_scheduler_with_optimizer=False)
    optimizer = torch.optim.SGD(RegressionModel().parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
    scheduler.step()
    assert scheduler.scheduler.last_epoch == 1


@pytest.mark.world_size(2)
def test_trigger_and_reduce():
    accelerator = Accelerator()
    if accelerator.process_index == 1:
        accelerator.set_trigger()
    assert accelerator.check_trigger() is True
    assert accelerator.check_trigger() is False  # cleared
    assert accelerator.reduce(torch.tensor([1.0])).item() == 2.0  # Accelerator.reduce defaults to sum


def test_bad_arguments():
    from hasten.exceptions import ConfigurationError

    with pytest.raises(ConfigurationError, match="mixed_precision 'fp32'"):
        Accelerator(mixed_precision="fp32")
    with pytest.raises(ConfigurationError, match="gradient_accumulation_steps=0"):
        Accelerator(gradient_accumulation_steps=0)
    with pytest.raises(ConfigurationError, match="not supported by hasten yet"):
        Accelerator(megatron_lm_plugin=object())
    with pytest.warns(FutureWarning, match="split_batches"):
        Accelerator(split_batches=True)
