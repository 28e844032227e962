"""torch's optimizer hooks on a prepared optimizer: registered on the wrapped optimizer, they fire on its real
steps (not on accumulation micro-steps), and torch's memory trackers can follow a prepared training step."""

from __future__ import annotations

import torch
from torch import nn

from hasten import Accelerator
from hasten.state import reset_state
from hasten.testing import run_on_ranks


def _prepared(accumulation: int = 1, **kwargs):
    reset_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation, **kwargs)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    return accelerator, *accelerator.prepare(model, optimizer)


def _train_step(accelerator, model, optimizer, seed):
    generator = torch.Generator().manual_seed(seed)
    with accelerator.accumulate(model):
        loss = model(torch.randn(4, 8, generator=generator)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()


def test_step_hooks_fire_on_real_steps_only():
    accelerator, model, optimizer = _prepared(accumulation=2)
    weight = next(model.parameters())
    calls = []

    def pre(opt, args, kwargs):
        calls.append(("pre", opt, weight.detach().clone()))

    def post(opt, args, kwargs):
        calls.append(("post", opt, weight.detach().clone()))

    handles = [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]
    for seed in range(4):  # 4 micro-steps, 2 optimizer steps
        _train_step(accelerator, model, optimizer, seed)
    assert [kind for kind, _, _ in calls] == ["pre", "post", "pre", "post"]
    assert all(opt is optimizer.optimizer for _, opt, _ in calls)  # torch passes the optimizer that steps
    # pre runs before the update and post after it: each pair sees the weights change
    assert not torch.equal(calls[0][2], calls[1][2]) and torch.equal(calls[1][2], calls[2][2])
    for handle in handles:
        handle.remove()
    for seed in range(2):
        _train_step(accelerator, model, optimizer, seed)
    assert len(calls) == 4


def test_state_dict_hooks_fire_through_the_wrapper():
    accelerator, model, optimizer = _prepared()
    _train_step(accelerator, model, optimizer, 0)
    seen = []
    optimizer.register_state_dict_pre_hook(lambda opt: seen.append("save-pre"))
    optimizer.register_state_dict_post_hook(lambda opt, sd: {**sd, "extra": 3})
    optimizer.register_load_state_dict_pre_hook(lambda opt, sd: seen.append(("load-pre", sd.get("extra"))))
    optimizer.register_load_state_dict_post_hook(lambda opt: seen.append("load-post"), prepend=True)
    state = optimizer.state_dict()
    assert state["extra"] == 3 and seen == ["save-pre"]
    optimizer.load_state_dict(state)
    assert seen == ["save-pre", ("load-pre", 3), "load-post"]


def test_hook_registration_on_an_optimizer_without_it_is_an_attribute_error():
    from hasten.optim import AcceleratedOptimizer

    class Bare:  # what some engines hand out: an optimizer that is not a torch.optim.Optimizer
        param_groups: list = []
        state: dict = {}

        def step(self):
            pass

    wrapped = AcceleratedOptimizer(Bare())  # type: ignore[arg-type]
    assert not hasattr(wrapped, "no_such_name")
    try:
        wrapped.register_step_pre_hook(lambda *a: None)
    except AttributeError as exc:
        assert "Bare" in str(exc) and "register_step_pre_hook" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_mem_tracker_follows_a_prepared_step():
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    accelerator, model, optimizer = _prepared()
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        _train_step(accelerator, model, optimizer, 0)
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    assert peak[_MemRefType.PARAM] == parameters and peak[_MemRefType.GRAD] == parameters
    assert peak[_MemRefType.OPT] >= 2 * parameters  # Adam's two moments, found by its step hooks


def _fsdp_mem_tracker(prepared: bool):
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import fully_shard

    from hasten.config.plugins.fsdp import FullyShardedDataParallelPlugin

    if prepared:
        accelerator, model, optimizer = _prepared(fsdp_plugin=FullyShardedDataParallelPlugin())
    else:  # the ground truth: torch alone
        torch.manual_seed(0)
        model = fully_shard(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    tracker = FSDPMemTracker(model, optimizer)  # registers step hooks on the optimizer it is handed
    inputs = torch.randn(4, 8)
    tracker.track_inputs((inputs,))
    with tracker:
        loss = model(inputs).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {when: {str(kind): size for kind, size in tracker.get_tracker_snapshot(when)[torch.device("cpu")].items()}
            for when in ("peak", "current")}


def test_fsdp_mem_tracker_follows_a_prepared_fsdp2_step():
    prepared = run_on_ranks(_fsdp_mem_tracker, world_size=2, args=(True,))
    plain = run_on_ranks(_fsdp_mem_tracker, world_size=2, args=(False,))
    assert prepared == plain
    assert prepared[0]["current"]["_FSDPRefType.OPT"] > 0  # Adam's state, found by the step post-hook
