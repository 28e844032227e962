"""Loop features around the step: LocalSGD, DDP communication hooks, unused parameters, compile, profiling."""

import json
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hasten import Accelerator, DDPCommunicationHookType, DistributedDataParallelKwargs, ProfileKwargs
from hasten.local_sgd import LocalSGD


def _rank_data(rank, n=8):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n, 4, generator=g)
    return x, x.sum(1, keepdim=True)


@pytest.mark.world_size(2)
def test_local_sgd_averages_every_k_steps():
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    x, y = _rank_data(accelerator.process_index)
    inner = accelerator.unwrap_model(model)
    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=2) as local_sgd:
        for step in range(4):
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            before = inner.weight.detach().clone()
            local_sgd.step()
            views = [torch.empty_like(before) for _ in range(2)]
            dist.all_gather(views, inner.weight.detach().clone())
            if step % 2 == 1:  # averaged: identical everywhere and equal to the mean of the local models
                mine = [torch.empty_like(before) for _ in range(2)]
                dist.all_gather(mine, before)
                assert torch.equal(views[0], views[1])
                assert torch.allclose(views[0], (mine[0] + mine[1]) / 2, atol=1e-7)
            else:  # local steps: the ranks diverge (no gradient all-reduce)
                assert not torch.equal(views[0], views[1])


@pytest.mark.world_size(2)
@pytest.mark.parametrize("hook,wire_dtype", [(DDPCommunicationHookType.FP16, torch.float16),
                                             (DDPCommunicationHookType.BF16, torch.bfloat16)])
def test_comm_hooks_compress_the_allreduce(hook, wire_dtype):
    seen = []
    real_allreduce = dist.all_reduce

    def spy(tensor, *args, **kwargs):
        seen.append(tensor.dtype)
        return real_allreduce(tensor, *args, **kwargs)

    dist.all_reduce = spy
    try:
        accelerator = Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(comm_hook=hook)])
        torch.manual_seed(0)
        model = accelerator.prepare(nn.Linear(4, 1))
        x, y = _rank_data(accelerator.process_index)
        nn.functional.mse_loss(model(x), y).backward()
    finally:
        dist.all_reduce = real_allreduce
    assert wire_dtype in seen
    grads = [torch.empty_like(model.module.weight.grad) for _ in range(2)]
    dist.all_gather(grads, model.module.weight.grad)
    assert torch.equal(grads[0], grads[1]) and model.module.weight.grad.dtype == torch.float32


@pytest.mark.world_size(2)
def test_power_sgd_trains():
    handler = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.POWER_SGD,
                                            comm_state_option={"matrix_approximation_rank": 1,
                                                               "start_powerSGD_iter": 2})
    accelerator = Accelerator(kwargs_handlers=[handler])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    x, y = _rank_data(accelerator.process_index)
    losses = []
    for _ in range(6):
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


class HalfUsed(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(2, 1)
        self.unused = nn.Linear(2, 1)

    def forward(self, x):
        return self.used(x)


@pytest.mark.world_size(2)
def test_unused_parameters_error_names_the_fix():
    accelerator = Accelerator()
    model = accelerator.prepare(HalfUsed())
    with pytest.raises(RuntimeError, match=r"DistributedDataParallelKwargs\(find_unused_parameters=True\)"):
        for _ in range(2):
            model(torch.ones(1, 2)).sum().backward()
    fixed = Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
    model = fixed.prepare(HalfUsed())
    for _ in range(2):
        model(torch.ones(1, 2)).sum().backward()


def test_torch_compile_trains():
    accelerator = Accelerator(dynamo_backend="inductor")  # compiles C++ on the CPU: ~15 s here
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
    x = torch.randn(8, 3)
    first = None
    for _ in range(5):
        loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        first = first if first is not None else loss.item()
    assert loss.item() < first
    assert accelerator.unwrap_model(model, keep_torch_compile=False) is not model
    assert isinstance(accelerator.unwrap_model(model, keep_torch_compile=False), nn.Linear)


@pytest.mark.world_size(2)
def test_profile_writes_a_chrome_trace_per_rank(tmp_path):
    accelerator = Accelerator()
    model = accelerator.prepare(nn.Linear(3, 3))
    with accelerator.profile(ProfileKwargs(activities=["cpu"], output_trace_dir=str(tmp_path))) as prof:
        model(torch.ones(2, 3)).sum().backward()
    assert prof is not None
    trace = tmp_path / f"profile_{accelerator.process_index}.json"
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("linear" in str(e.get("name", "")).lower() or "addmm" in str(e.get("name", "")) for e in events)
    assert sorted(os.listdir(tmp_path)) == ["profile_0.json", "profile_1.json"]
