"""DeepSpeed ZeRO through the Accelerator loop, on 2 CPU ranks with gloo, against DDP.

Ground truth: the same seed, data, optimizer and clipping through hasten's DDP path. ZeRO 1-3 only
change where optimizer states, gradients and parameters live, so the weights must agree.

Tolerance: fp32 throughout. DeepSpeed averages gradients in flat buffers and computes the clipping
norm over partitions, DDP over buckets and per-parameter norms: the same numbers summed in another
order, ~1e-7 relative per operation. Adam's update is ~lr per element whatever the gradient size, so
rounding does not grow over four steps; ``atol=1e-5`` (lr is 1e-2, weights move ~4e-2) is 100x the
expected noise and 1000x smaller than any real mistake (a missed all-reduce, a gradient not averaged,
a skipped or doubled step each move weights by ~1e-2).

The parent imports deepspeed once (fixture) so the forked ranks start without paying for it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator
from hasten.config.plugins.deepspeed import DeepSpeedPlugin
from hasten.state import reset_state
from hasten.utils.deepspeed import DummyOptim, DummyScheduler

STEPS = 4
BATCH = 4  # per rank
LR = 1e-2
ATOL = 1e-5

pytestmark = pytest.mark.usefixtures("deepspeed_in_parent")  # tests/conftest.py


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def _loader(n: int = 2 * BATCH * STEPS) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 6, generator=g)
    y = torch.randn(n, 3, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH)


def _train(plugin: DeepSpeedPlugin | None, steps: int = STEPS, accumulation: int = 1, scheduler: bool = False,
           save_at: int | None = None, folder: str | None = None, resume: str | None = None) -> dict[str, torch.Tensor]:
    """The user's loop; returns the full weights. Optionally saves after ``save_at`` steps or resumes."""
    reset_state()
    accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=accumulation)
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    objects = [model, optimizer, _loader()]
    if scheduler:
        objects.append(torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5))
    prepared = accelerator.prepare(*objects)
    model, optimizer, loader = prepared[:3]
    sched = prepared[3] if scheduler else None
    if resume is not None:
        accelerator.load_state(resume)
        loader = accelerator.skip_first_batches(loader, save_at)
    done = save_at if resume is not None else 0
    for x, y in loader:
        if done == steps:
            break
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients and plugin is None:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)  # DeepSpeed's "auto" clipping is 1.0
            optimizer.step()
            if sched is not None:
                sched.step()
            optimizer.zero_grad()
        done += 1
        if save_at is not None and resume is None and done == save_at:
            accelerator.save_state(folder)
    return accelerator.get_state_dict(model)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.world_size(2, timeout=240)
def test_zero_stages_match_ddp():
    reference = _train(None)
    start = {k: v.float() for k, v in _model().state_dict().items()}
    assert _max_diff(reference, start) > 1e-2  # training really moved the weights
    for stage in (1, 2, 3):
        weights = _train(DeepSpeedPlugin(zero_stage=stage))
        assert _max_diff(weights, reference) < ATOL, f"ZeRO-{stage}"


@pytest.mark.world_size(2, timeout=240)
def test_accumulation_and_scheduler_match_ddp():
    # 8 micro-batches, 4 optimizer steps, StepLR halving each step: a double step would change the lr.
    reference = _train(None, steps=8, accumulation=2, scheduler=True)
    weights = _train(DeepSpeedPlugin(zero_stage=2), steps=8, accumulation=2, scheduler=True)
    assert _max_diff(weights, reference) < ATOL


@pytest.mark.world_size(2, timeout=240)
def test_auto_json_config_filled_from_accelerator(tmp_path):
    folder = tmp_path
    config = {
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 2, "overlap_comm": False, "contiguous_gradients": True,
                              "reduce_bucket_size": "auto", "allgather_bucket_size": 5e8},
    }
    path = folder / "ds_config.json"
    path.write_text(json.dumps(config))
    model = _model()
    model.config = type("Config", (), {"hidden_size": 16})()  # a transformers-like model config
    reset_state()
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=str(path)), gradient_accumulation_steps=2)
    accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR), _loader())
    filled = accelerator.deepspeed_plugin.deepspeed_config
    assert filled["train_micro_batch_size_per_gpu"] == BATCH
    assert filled["train_batch_size"] == BATCH * 2 * 2  # micro * accumulation * processes
    assert filled["gradient_accumulation_steps"] == 2
    assert filled["gradient_clipping"] == 1.0
    assert filled["fp16"]["enabled"] is False and filled["bf16"]["enabled"] is False
    assert filled["zero_optimization"]["reduce_bucket_size"] == 16 * 16
    engine = accelerator._models[0]
    assert engine.train_micro_batch_size_per_gpu() == BATCH and engine.gradient_accumulation_steps() == 2
    assert json.loads(path.read_text()) == config  # the user's file is not modified


@pytest.mark.world_size(2, timeout=240)
def test_save_load_continue_equals_uninterrupted(tmp_path):
    folder = str(tmp_path / "ckpt")  # resolved in the parent: the same folder on both ranks
    for stage in (2, 3):
        uninterrupted = _train(DeepSpeedPlugin(zero_stage=stage), scheduler=True)
        _train(DeepSpeedPlugin(zero_stage=stage), scheduler=True, save_at=2, folder=f"{folder}{stage}")
        assert (Path(f"{folder}{stage}") / "pytorch_model").is_dir()
        resumed = _train(DeepSpeedPlugin(zero_stage=stage), scheduler=True, save_at=2, resume=f"{folder}{stage}")
        assert _max_diff(resumed, uninterrupted) == 0.0, f"ZeRO-{stage}"


@pytest.mark.world_size(2, timeout=240)
def test_bf16_and_dummy_optimizer_from_config():
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1,
              "zero_allow_untested_optimizer": True,  # DeepSpeed's own SGD: no C++ extension to build
              "optimizer": {"type": "SGD", "params": {"lr": "auto", "weight_decay": "auto"}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                            "warmup_num_steps": "auto"}},
              "zero_optimization": {"stage": 1}}
    reset_state()
    accelerator = Accelerator(mixed_precision="bf16", deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    model = _model()
    optimizer = DummyOptim(model.parameters(), lr=LR)
    scheduler = DummyScheduler(optimizer, warmup_num_steps=4)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, _loader(), scheduler)
    assert next(model.parameters()).dtype == torch.bfloat16
    lrs = []
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x.to(torch.bfloat16)).float(), y)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()  # a no-op: the engine stepped it
        optimizer.zero_grad()
        lrs.append(scheduler.get_last_lr()[0])
    # WarmupLR (log warm-up over 4 steps to LR) stepped once per optimizer step, not twice.
    assert lrs[-1] == pytest.approx(LR) and lrs[0] < lrs[1] < lrs[2] < LR
    assert accelerator.deepspeed_plugin.deepspeed_config["optimizer"]["params"]["lr"] == LR


LAUNCHED_SCRIPT = '''
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from hasten import Accelerator

accelerator = Accelerator()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(8, 4, generator=torch.Generator().manual_seed(1))), batch_size=4)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
for (x,) in loader:
    accelerator.backward(model(x).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()
state = accelerator.get_state_dict(model)
if accelerator.is_main_process:
    plugin = accelerator.deepspeed_plugin
    print("RESULT", accelerator.distributed_type, accelerator.num_processes, plugin.zero_stage,
          plugin.deepspeed_config["train_batch_size"], float(state["2.bias"][0]), flush=True)
accelerator.end_training()
'''


@pytest.mark.launch
def test_hasten_launch_use_deepspeed_runs_a_script_end_to_end(tmp_path):
    import os
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(LAUNCHED_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "hasten.commands.main", "launch", "--cpu", "--num_processes", "2",
                           "--use_deepspeed", "--zero_stage", "3", "--gradient_clipping", "0", str(script)],
                          capture_output=True, text=True, timeout=180, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    assert lines, done.stdout[-3000:] + done.stderr[-3000:]
    _, kind, processes, stage, global_batch, bias = lines[0].split()
    assert (kind, processes, stage, global_batch) == ("DEEPSPEED", "2", "3", "8")
    # The same step in one process on the whole batch (one batch of 4 per rank = the 8 samples).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    model(torch.randn(8, 4, generator=torch.Generator().manual_seed(1))).pow(2).mean().backward()
    assert float(bias) == pytest.approx(float((model[2].bias - 0.1 * model[2].bias.grad)[0].detach()), abs=1e-6)
    assert done.returncode == 0, done.stderr[-2000:]


# --------------------------------------------------------------- all-or-nothing loads (issue 33)
def _tree_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_tree_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_tree_equal(x, y) for x, y in zip(a, b))
    return a == b


def _clone_tree(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clone_tree(v) for v in value]
    return value


def _prepared_two_layers(width: int, stage: int):
    reset_state()
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=stage))
    torch.manual_seed(width)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, width))
    loader = DataLoader(TensorDataset(torch.randn(8, 8)), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, torch.optim.Adam(model.parameters(), lr=0.1), loader)
    (x,) = next(iter(loader))
    accelerator.backward(model(x).pow(2).mean())  # one step: the optimizer state is not empty
    return accelerator, model, optimizer


def _save_two_layers(root: str, stage: int) -> None:
    _prepared_two_layers(8, stage)[0].save_state(Path(root) / "ck")


def _load_into_a_wider_model(root: str, stage: int, save: bool = True) -> tuple[str, bool, bool]:
    if save:
        _save_two_layers(root, stage)
    folder = Path(root) / "ck"
    accelerator, model, optimizer = _prepared_two_layers(16, stage)
    weights = {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}
    state = _clone_tree(optimizer.state_dict())
    try:
        accelerator.load_state(folder)
        error = "loaded"
    except Exception as exc:  # noqa: BLE001 - the test reports what was raised
        error = f"{type(exc).__name__}: {exc}"
    same_weights = _tree_equal(weights, dict(accelerator.get_state_dict(model)))
    return error, same_weights, _tree_equal(state, _clone_tree(optimizer.state_dict()))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_a_zero_checkpoint_of_another_shape_changes_nothing_on_every_rank(tmp_path, stage):
    from hasten.testing import run_on_ranks

    results = run_on_ranks(_load_into_a_wider_model, world_size=2, args=(str(tmp_path), stage), timeout=300)
    (error0, weights0, optim0), (error1, weights1, optim1) = results
    assert error0 == error1 and error0.startswith("CheckpointError"), results
    assert weights0 and weights1, "a weight changed (layer 0 matches and was overwritten)"
    assert optim0 and optim1, "the optimizer state changed"
    assert "_model_states.pt does not match the prepared model" in error0, error0  # ZeRO-3: one per rank
    assert "1.weight: file (8, 8) vs model (16, 8)" in error0 and "1.bias: file (8,) vs model (16,)" in error0


@pytest.mark.slow
def test_a_zero3_checkpoint_of_another_shape_is_refused_before_the_conversion_to_another_count(tmp_path):
    from hasten.testing import run_on_ranks

    run_on_ranks(_save_two_layers, world_size=2, args=(str(tmp_path), 3), timeout=300)
    ((error, same_weights, same_optimizer),) = run_on_ranks(_load_into_a_wider_model, world_size=1,
                                                            args=(str(tmp_path), 3, False), timeout=300)
    assert error.startswith("CheckpointError") and "1.weight: file (8, 8) vs model (16, 8)" in error, error
    assert same_weights and same_optimizer  # today's code converted it and loaded it without an error


@pytest.mark.slow
@pytest.mark.world_size(2, timeout=600)
def test_zero3_cpu_optimizer_offload_matches_ddp():
    """ZeRO-3 + optimizer offload: torch Adam becomes DeepSpeedCPUAdam (C++ extension, built on first use)."""
    from hasten.strategies.deepspeed import import_deepspeed

    import_deepspeed("cpu")
    reference = _train(None)
    start = time.perf_counter()
    weights = _train(DeepSpeedPlugin(zero_stage=3, offload_optimizer_device="cpu"))
    print(f"ZeRO-3 + CPU Adam offload run (extension build included on first use): {time.perf_counter() - start:.1f}s")
    # CPU Adam vectorises Adam's update (same formula, fused): rounding differences only.
    assert _max_diff(weights, reference) < 1e-5
