"""Mixed precision, fp16 skipped steps, clipping and gradient accumulation against hand-computed truth."""

import pickle

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from hasten import Accelerator, GradientAccumulationPlugin, GradScalerKwargs
from hasten.exceptions import ConfigurationError
from hasten.testing import run_on_ranks


class Probe(nn.Module):
    """Records the dtype its inner matmul produced during forward."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.seen = []

    def forward(self, x):
        out = self.linear(x)
        self.seen.append(out.dtype)
        return out


def test_bf16_autocast_in_forward_and_fp32_outputs():
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    model = accelerator.prepare(Probe())
    out = model(torch.randn(2, 4))
    assert model.seen[-1] == torch.bfloat16 and out.dtype == torch.float32
    with accelerator.autocast():
        assert (torch.randn(2, 2) @ torch.randn(2, 2)).dtype == torch.bfloat16
    plain = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    assert plain(torch.randn(2, 4)).dtype == torch.float32 and plain.seen[-1] == torch.float32
    pickle.dumps(plain)  # an unwrapped model pickles


def test_fp16_on_cpu_really_runs_fp16():
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    assert accelerator.mixed_precision == "fp16" and accelerator.scaler is not None and accelerator.native_amp
    model = accelerator.prepare(Probe())
    assert model(torch.randn(2, 4)).dtype == torch.float32
    assert model.seen[-1] == torch.float16


def test_fp16_overflow_skips_step_and_shrinks_scale():
    # A modest initial scale: with 65536 this tiny loss's fp16 gradients would overflow for real.
    accelerator = Accelerator(cpu=True, mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)])
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    before = [p.detach().clone() for p in model.parameters()]
    scale = accelerator.scaler.get_scale()
    accelerator.backward(model(torch.ones(2, 3)).sum())
    model.weight.grad[0, 0] = float("inf")
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    assert optimizer.step_was_skipped and accelerator.optimizer_step_was_skipped
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert accelerator.scaler.get_scale() == scale * 0.5
    assert scheduler.get_last_lr() == [0.1]  # the scheduler did not step
    accelerator.backward(model(torch.ones(2, 3)).sum())
    optimizer.step()
    scheduler.step()
    assert not optimizer.step_was_skipped
    assert not torch.equal(before[0], model.weight)
    assert scheduler.get_last_lr() == [0.05]


def test_clip_grad_norm_matches_torch_on_unscaled_gradients():
    torch.manual_seed(0)
    reference = nn.Linear(5, 2)
    model = nn.Linear(5, 2)
    model.load_state_dict(reference.state_dict())
    x = torch.randn(4, 5)
    reference(x).pow(2).sum().backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with torch.autocast("cpu", enabled=False):
        accelerator.backward(model.module(x).pow(2).sum() if hasattr(model, "module") else
                             accelerator.unwrap_model(model, keep_fp32_wrapper=False)(x).pow(2).sum())
    norm = accelerator.clip_grad_norm_(model.parameters(), 0.5)
    assert norm.item() == pytest.approx(expected.item(), rel=1e-5)
    for p, r in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p.grad, r.grad, rtol=1e-5, atol=1e-6)


def _accumulate_body(world, steps, micro, batch, windows):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=micro)
    torch.manual_seed(3)
    model = nn.Linear(3, 1)
    data = torch.randn(windows * micro * batch * world, 3, generator=torch.Generator().manual_seed(5))
    target = data.sum(1, keepdim=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    calls = []
    if isinstance(model, nn.parallel.DistributedDataParallel):
        def counting_hook(state, bucket):
            calls.append(1)
            return default_hooks.allreduce_hook(state, bucket)
        model.register_comm_hook(None, counting_hook)
    rank = accelerator.process_index
    for step in range(windows * micro):
        start = (step * world + rank) * batch
        x, y = data[start:start + batch], target[start:start + batch]
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    inner = accelerator.unwrap_model(model)
    return inner.weight.detach().clone(), inner.bias.detach().clone(), len(calls)


def test_accumulation_equals_large_batch():
    windows, micro, batch = 2, 4, 4
    # Ground truth: one process, one step per window of 32 samples.
    torch.manual_seed(3)
    model = nn.Linear(3, 1)
    data = torch.randn(windows * micro * batch * 2, 3, generator=torch.Generator().manual_seed(5))
    target = data.sum(1, keepdim=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for w in range(windows):
        x, y = data[w * 32:(w + 1) * 32], target[w * 32:(w + 1) * 32]
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    results = run_on_ranks(_accumulate_body, world_size=2, args=(2, None, micro, batch, windows))
    for weight, bias, allreduces in results:
        assert torch.allclose(weight, model.weight, atol=1e-6) and torch.allclose(bias, model.bias, atol=1e-6)
        assert allreduces == windows  # DDP communicated only on the synchronising micro-steps
    single = _accumulate_body(1, None, micro, batch * 2, windows)
    assert torch.allclose(single[0], model.weight, atol=1e-6)


def test_accumulation_arguments():
    with pytest.raises(ConfigurationError, match="Both gradient_accumulation_steps=2"):
        Accelerator(cpu=True, gradient_accumulation_steps=2, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2))
    accelerator = Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=3))
    assert accelerator.gradient_accumulation_steps == 3
    accelerator.gradient_accumulation_steps = 5
    assert accelerator.gradient_accumulation_steps == 5
    with pytest.raises(ConfigurationError):
        accelerator.gradient_accumulation_steps = 0


def test_sync_pattern_without_loader():
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    model = nn.Linear(1, 1)
    syncs = []
    for _ in range(10):
        with accelerator.accumulate(model):
            syncs.append(accelerator.sync_gradients)
    assert [i for i, s in enumerate(syncs, 1) if s] == [4, 8]


def test_accumulate_as_a_decorator_advances_on_every_call():
    """``accumulate`` returned a contextlib generator context, usable as a decorator: that still holds."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = accelerator.prepare(nn.Linear(1, 1))
    syncs = []

    @accelerator.accumulate(model)
    def micro_step():
        syncs.append(accelerator.sync_gradients)

    for _ in range(4):
        micro_step()
    assert syncs == [False, True, False, True]


def test_accumulate_unwinds_entered_contexts_when_one_fails_to_enter():
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    events = []

    class Recording:
        def __init__(self, name, fail=False):
            self.name, self.fail = name, fail

        def __enter__(self):
            if self.fail:
                raise RuntimeError("cannot enter")
            events.append(f"enter {self.name}")

        def __exit__(self, *exc):
            events.append(f"exit {self.name}")

    first, second = nn.Linear(1, 1), nn.Linear(1, 1)
    contexts = {id(first): Recording("first"), id(second): Recording("second", fail=True)}
    accelerator._strategy.no_sync = lambda model: contexts[id(model)]  # a strategy whose no_sync really acts
    with pytest.raises(RuntimeError, match="cannot enter"):
        with accelerator.accumulate(first, second):
            pass
    assert events == ["enter first", "exit first"]
    contexts[id(second)].fail = False
    events.clear()
    with accelerator.accumulate(first, second):  # step 2 of 2 synchronises: nothing entered
        pass
    with accelerator.accumulate(first, second):
        events.append("body")
    assert events == ["enter first", "enter second", "body", "exit second", "exit first"]
