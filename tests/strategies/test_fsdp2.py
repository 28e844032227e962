"""FSDP2 through the Accelerator loop: sharded training equals full-batch single-process training.

Ground truth: with the same initial weights and data, data-parallel training on 2 ranks with batch b
each is, step for step, single-process training on the 2b-sample batch (the averaged gradient is
the full-batch mean gradient). Each test runs several configurations inside one 2-rank run, so
process start-up (most of a test's time) happens once per test.

Tolerances: fp32 runs differ from the reference only by summation order (the reduce-scatter adds two
half-batch gradients, the reference sums one full batch): ~1e-7 relative per step. Three AdamW steps
at lr 1e-2 measured 5e-8 here; ``atol=1e-5`` leaves room for other BLAS builds while any real
mistake (a wrong shard, a missed all-reduce, stale optimizer parameters) moves weights by ~1e-2.
bf16 runs gather parameters and compute in bf16 (8-bit mantissa, ~4e-3 relative per op) while the
optimizer keeps fp32 shards. They use SGD (an update proportional to the gradient; Adam's ~lr*sign
would turn rounding of near-zero gradients into full-size differences) and are compared with the fp32
reference at ``atol=5e-3``: measured 1.1e-3, against weight changes up to 6e-2 in three steps.
"""

from __future__ import annotations

import multiprocessing
import pickle
import traceback
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from hasten import Accelerator
from hasten.config.plugins.fsdp import FullyShardedDataParallelPlugin
from hasten.state import reset_state
from hasten.testing import run_on_ranks

STEPS = 3
BATCH = 8  # per rank; the reference uses 2 * BATCH
LR = 1e-2


class Block(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    """A transformer-like stack: input projection, residual blocks, a 1-output head (uneven shards)."""

    def __init__(self, width: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(6, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)
        self.register_buffer("offset", torch.tensor([0.25]), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h) + self.offset


def data(n: int = 2 * BATCH * (STEPS + 2), seed: int = 3) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).sin())


def make_model(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def rank_batches(rank: int, world: int, steps: int = STEPS, first: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's part of full batches ``first .. first+steps-1`` (2 * BATCH samples each)."""
    x, y = data().tensors
    size = 2 * BATCH // world
    starts = [step * 2 * BATCH + rank * size for step in range(first, first + steps)]
    return [(x[s:s + size], y[s:s + size]) for s in starts]


def make_optimizer(params, kind: str = "adamw") -> torch.optim.Optimizer:
    # SGD's update is proportional to the gradient, so bf16 rounding stays small; Adam's is ~lr * sign.
    return torch.optim.AdamW(params, lr=LR) if kind == "adamw" else torch.optim.SGD(params, lr=0.1)


def reference(steps: int = STEPS, clip: float | None = None, optim: str = "adamw") -> tuple[dict[str, torch.Tensor], list[float]]:
    """Single process, full batch, same initial weights and data order; also the pre-clip norms."""
    model = make_model()
    optimizer = make_optimizer(model.parameters(), optim)
    norms = []
    for x, y in rank_batches(0, 1, steps):
        nn.functional.mse_loss(model(x), y).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def _registry(module: nn.Module) -> set[str]:
    from torch.distributed._composable.contract import _get_registry

    return set(_get_registry(module) or {})


def _probe(model: nn.Module) -> dict:
    """What FSDP did to the model: units, checkpointed blocks, weights seen in forward, after forward."""
    seen: dict = {}
    block = model.blocks[0]
    handle = block.up.register_forward_hook(lambda m, i, o: seen.update(dtype=str(m.weight.dtype)))
    model(torch.zeros(2, 6)).sum()  # forward only: is the block's weight resharded afterwards?
    handle.remove()
    from torch.distributed.tensor import DTensor

    seen["resharded_after_forward"] = isinstance(block.up.weight, DTensor)
    seen["units"] = sorted(n for n, m in model.named_modules() if n and "fully_shard" in _registry(m))
    seen["checkpointed"] = sorted(n for n, m in model.named_modules() if "checkpoint" in _registry(m))
    model.zero_grad(set_to_none=True)
    return seen


def train_fsdp(plugin_kwargs: dict, mixed_precision: str = "no", steps: int = STEPS, other_rank_seed: int | None = None,
               clip: float | None = None, accumulate: int = 1, optim: str = "adamw") -> tuple[dict[str, torch.Tensor], dict]:
    """One sharded run on the current ranks; returns (gathered weights on rank 0 else {}, facts)."""
    reset_state()
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(**plugin_kwargs),
                              mixed_precision=mixed_precision, gradient_accumulation_steps=accumulate)
    # Rank 1 may build different weights: hasten gives every rank rank 0's weights when sharding.
    seed = other_rank_seed if other_rank_seed is not None and accelerator.process_index > 0 else 0
    model = make_model(seed)
    optimizer = make_optimizer(model.parameters(), optim)
    model, optimizer = accelerator.prepare(model, optimizer)
    facts = _probe(model)
    facts["norms"] = []
    for x, y in rank_batches(accelerator.process_index, accelerator.num_processes, steps):
        for xs, ys in zip(x.chunk(accumulate), y.chunk(accumulate)):
            with accelerator.accumulate(model):
                accelerator.backward(nn.functional.mse_loss(model(xs), ys))
                if clip is not None and accelerator.sync_gradients:
                    facts["norms"].append(float(accelerator.clip_grad_norm_(model.parameters(), clip)))
                optimizer.step()
                optimizer.zero_grad()
    return accelerator.get_state_dict(model), facts


def assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float) -> None:
    assert set(got) == set(want)
    for key, value in got.items():
        torch.testing.assert_close(value.float(), want[key].float(), atol=atol, rtol=0, msg=key)


WRAP_BLOCKS = {"transformer_cls_names_to_wrap": ["Block"]}
# (plugin kwargs, train kwargs, expected units, expected checkpointed modules, resharded after forward)
CASES = [
    ({}, {}, [], [], False),  # the root alone: kept gathered for the backward that follows at once
    ({"auto_wrap_policy": "transformer_based_wrap", **WRAP_BLOCKS}, {}, ["blocks.0", "blocks.1"], [], True),
    ({"transformer_cls_names_to_wrap": "Block", "reshard_after_forward": False}, {}, ["blocks.0", "blocks.1"], [], False),
    ({"min_num_params": 600, "cpu_offload": True}, {}, ["blocks.0", "blocks.1"], [], True),
    ({**WRAP_BLOCKS, "activation_checkpointing": True}, {}, ["blocks.0", "blocks.1"], ["blocks.0", "blocks.1"], True),
    ({"cpu_ram_efficient_loading": True, **WRAP_BLOCKS}, {"other_rank_seed": 10}, ["blocks.0", "blocks.1"], [], True),
    ({}, {"other_rank_seed": 10, "accumulate": 2}, [], [], False),
]


def _train_cases() -> list:
    return [train_fsdp(plugin, **kwargs) for plugin, kwargs, *_ in CASES]


def test_fsdp2_equals_full_batch_training_in_every_configuration():
    want, _ = reference()
    rank0, rank1 = run_on_ranks(_train_cases, world_size=2)
    assert all(state == {} for state, _ in rank1)  # gathered on the main process only
    for (plugin, _kwargs, units, checkpointed, resharded), (got, facts) in zip(CASES, rank0):
        assert facts["units"] == units, plugin
        assert facts["checkpointed"] == checkpointed, plugin
        assert facts["resharded_after_forward"] is resharded, plugin
        assert_close(got, want, atol=1e-5)
    assert not torch.allclose(want["head.weight"], make_model().head.weight)  # it trained


def _mixed_precision_and_clipping() -> list:
    return [train_fsdp(WRAP_BLOCKS, mixed_precision="bf16", optim="sgd"),
            train_fsdp({"mixed_precision_policy": {"param_dtype": "bfloat16", "reduce_dtype": "float32"}}, optim="sgd"),
            train_fsdp(WRAP_BLOCKS, clip=0.05)]


def test_bf16_policy_and_global_gradient_clipping():
    want, _ = reference(optim="sgd")
    clipped, norms = reference(clip=0.05)
    results = run_on_ranks(_mixed_precision_and_clipping, world_size=2)
    (bf16, bf16_facts), (policy, policy_facts), (clip, clip_facts) = results[0]
    assert bf16_facts["dtype"] == policy_facts["dtype"] == "torch.bfloat16"  # parameters gathered in bf16
    assert_close(bf16, want, atol=5e-3)
    assert_close(policy, want, atol=5e-3)
    # The norm is the global one (same on both ranks, equal to the full-batch norm), and clipping by it
    # gives the full-batch clipped training.
    assert results[1][2][1]["norms"] == clip_facts["norms"]
    assert clip_facts["norms"] == pytest.approx(norms, rel=1e-5)
    assert min(norms) > 0.05  # clipping really happened
    assert_close(clip, clipped, atol=1e-5)


# ------------------------------------------------------------------------------------ checkpoints
def _step(accelerator, model, optimizer, scheduler, x, y) -> None:
    accelerator.backward(nn.functional.mse_loss(model(x), y))
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def _prepared(state_dict_type: str, seed: int = 0):
    reset_state()
    # The scheduler steps once per call, so 1-process and 2-process runs follow the same schedule.
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(state_dict_type=state_dict_type, **WRAP_BLOCKS),
                              step_scheduler_with_optimizer=False)
    model = make_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    return (accelerator, *accelerator.prepare(model, optimizer, scheduler))


def _save_and_resume(root: str) -> list:
    """Per format: uninterrupted 4 steps vs (2 steps, save, fresh model, load, 2 steps)."""
    out = []
    for saved_as, loaded_as in (("SHARDED_STATE_DICT", "FULL_STATE_DICT"), ("FULL_STATE_DICT", "SHARDED_STATE_DICT")):
        folder = Path(root) / saved_as
        accelerator, model, optimizer, scheduler = _prepared(saved_as)
        batches = rank_batches(accelerator.process_index, accelerator.num_processes, steps=4)
        for i, (x, y) in enumerate(batches):
            if i == 2:
                accelerator.save_state(folder)
                at_save = accelerator.get_state_dict(model)
            _step(accelerator, model, optimizer, scheduler, x, y)
        uninterrupted = accelerator.get_state_dict(model)
        # The other format's plugin: a checkpoint loads whatever state_dict_type it was saved with.
        accelerator, model, optimizer, scheduler = _prepared(loaded_as, seed=5)
        accelerator.load_state(folder)
        for x, y in batches[2:]:
            _step(accelerator, model, optimizer, scheduler, x, y)
        out.append((at_save, uninterrupted, accelerator.get_state_dict(model), sorted(p.name for p in folder.iterdir())))
    return out


def _resume_in_one_process(folder: str) -> dict[str, torch.Tensor]:
    accelerator, model, optimizer, scheduler = _prepared("SHARDED_STATE_DICT", seed=5)
    assert accelerator.num_processes == 1 and accelerator.distributed_type == "FSDP"
    accelerator.load_state(folder)
    for x, y in rank_batches(0, 1, steps=2, first=2):
        _step(accelerator, model, optimizer, scheduler, x, y)
    return accelerator.get_state_dict(model)


def in_fresh_process(fn, *args):
    """Run ``fn`` in a forked child with no process group and fresh hasten state (one-process runs)."""
    ctx = multiprocessing.get_context("fork")
    receiver, sender = ctx.Pipe(duplex=False)

    def target() -> None:
        import os

        torch.set_num_threads(1)
        try:
            reset_state()
            reply = ("ok", fn(*args))
        except BaseException:
            reply = ("error", traceback.format_exc())
        # Plain pickle: torch's multiprocessing pickler would share tensors through this exiting process.
        sender.send_bytes(pickle.dumps(reply))
        os._exit(0)

    process = ctx.Process(target=target)
    process.start()
    assert receiver.poll(120), "the child process did not answer"
    kind, value = pickle.loads(receiver.recv_bytes())
    process.join()
    if kind == "error":
        raise AssertionError(value)
    return value


def test_sharded_and_full_checkpoints_resume_exactly_and_merge(tmp_path):
    from safetensors.torch import load_file

    from hasten.commands.main import main

    results = run_on_ranks(_save_and_resume, world_size=2, args=(str(tmp_path),))
    (sharded, full) = results[0]
    for _at_save, uninterrupted, resumed, _files in (sharded, full):
        assert set(resumed) == set(uninterrupted)
        for key in uninterrupted:
            assert torch.equal(resumed[key], uninterrupted[key]), key  # DCP and safetensors round-trip exactly
    assert {"pytorch_model_fsdp_0", "optimizer_0", "random_states_0.pkl", "random_states_1.pkl",
            "scheduler.bin"} <= set(sharded[3]) and "model.safetensors" not in sharded[3]
    assert {"model.safetensors", "optimizer.bin"} <= set(full[3]) and "pytorch_model_fsdp_0" not in full[3]

    # A 2-process sharded checkpoint resumes in one process (DCP reshards) and gives the same weights.
    resumed_alone = in_fresh_process(_resume_in_one_process, str(tmp_path / "SHARDED_STATE_DICT"))
    for key, value in sharded[1].items():
        torch.testing.assert_close(resumed_alone[key], value, atol=1e-6, rtol=0)

    # merge-weights: the save_state folder -> model.safetensors that loads into the plain model.
    assert main(["merge-weights", str(tmp_path / "SHARDED_STATE_DICT"), str(tmp_path / "merged")]) == 0
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    plain, expected = Net(), Net()
    plain.load_state_dict(merged)
    expected.load_state_dict(sharded[0])
    x = data().tensors[0][:5]
    assert torch.equal(plain(x), expected(x))
    # ... and from the DCP folder itself, as Accelerate's command takes it.
    assert main(["merge-weights", str(tmp_path / "SHARDED_STATE_DICT" / "pytorch_model_fsdp_0"),
                 str(tmp_path / "merged2"), "--unsafe_serialization"]) == 0
    binary = torch.load(tmp_path / "merged2" / "pytorch_model.bin", weights_only=True)
    assert all(torch.equal(binary[k], merged[k]) for k in merged)


def test_merge_weights_rejects_a_folder_without_shards(tmp_path, capsys):
    from hasten.commands.main import main

    (tmp_path / "model.safetensors").write_bytes(b"")
    assert main(["merge-weights", str(tmp_path), str(tmp_path / "out")]) == 1
    assert "SHARDED_STATE_DICT" in capsys.readouterr().err
    assert main(["merge-weights", str(tmp_path / "missing"), str(tmp_path / "out")]) == 1



def _train_alone() -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    state, facts = train_fsdp(WRAP_BLOCKS)
    assert dist.is_initialized() and dist.get_world_size() == 1  # hasten's private one-rank group
    assert facts["units"] == ["blocks.0", "blocks.1"]
    return state


def test_one_process_runs_fsdp2_on_a_one_rank_mesh():
    want, _ = reference()
    assert_close(in_fresh_process(_train_alone), want, atol=1e-6)


# ------------------------------------------------------------------------------------- bad input
def _bad_inputs(root: str) -> dict:
    from hasten.checkpointing import CheckpointError
    from hasten.exceptions import ConfigurationError

    errors = {}
    reset_state()
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
    model = make_model()
    with pytest.raises(ConfigurationError) as info:
        accelerator.prepare(model)  # optimizer missing
    errors["no_optimizer"] = str(info.value)
    with pytest.raises(ConfigurationError) as info:
        accelerator.prepare(model, torch.optim.SGD(list(model.parameters()) + [nn.Parameter(torch.zeros(3))], lr=0.1))
    errors["foreign"] = str(info.value)

    reset_state()
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Nope"]))
    model = make_model()
    with pytest.raises(ConfigurationError) as info:
        accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    errors["wrap_class"] = str(info.value)

    reset_state()
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
    meta = make_model()
    meta.to("meta")
    with pytest.raises(ConfigurationError) as info:
        accelerator.prepare(meta, torch.optim.SGD(meta.parameters(), lr=0.1))  # meta on rank 0 too
    errors["meta"] = str(info.value)

    # A frozen model may be prepared alone; a checkpoint of another shape is refused before loading.
    frozen = make_model().requires_grad_(False)
    frozen = accelerator.prepare(frozen)
    errors["frozen_sharded"] = type(frozen).__name__
    for state_dict_type in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
        reset_state()
        accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(state_dict_type=state_dict_type))
        model = make_model()
        accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        accelerator.save_state(Path(root) / state_dict_type)
        reset_state()
        accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
        narrow = Net(width=8)
        narrow, _ = accelerator.prepare(narrow, torch.optim.SGD(narrow.parameters(), lr=0.1))
        before = accelerator.get_state_dict(narrow)
        with pytest.raises(CheckpointError) as info:
            accelerator.load_state(Path(root) / state_dict_type)
        errors[f"mismatch_{state_dict_type}"] = str(info.value)
        after = accelerator.get_state_dict(narrow)
        errors[f"unchanged_{state_dict_type}"] = all(torch.equal(before[k], after[k]) for k in before)
    return errors


def test_bad_inputs_raise_clear_errors(tmp_path):
    errors = run_on_ranks(_bad_inputs, world_size=2, args=(str(tmp_path),))
    assert errors[0] == errors[1]  # every rank raises (no rank left waiting in a collective)
    errors = errors[0]
    assert "accelerator.prepare(model, optimizer)" in errors["no_optimizer"]
    assert "not in Net" in errors["foreign"]
    assert "Nope" in errors["wrap_class"] and "Block" in errors["wrap_class"]
    assert "meta device on rank 0" in errors["meta"]
    assert errors["frozen_sharded"].startswith("FSDP")
    for kind in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
        assert "shape mismatches" in errors[f"mismatch_{kind}"] and "Nothing was loaded" in errors[f"mismatch_{kind}"]
        assert errors[f"unchanged_{kind}"]


# ----------------------------------------------------------------------------------------- launch
LAUNCHED_SCRIPT = '''
import torch
from torch import nn
from hasten import Accelerator

accelerator = Accelerator()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1)).chunk(2)[accelerator.process_index]
accelerator.backward(model(x).pow(2).mean())
optimizer.step()
state = accelerator.get_state_dict(model)
if accelerator.is_main_process:
    plugin = accelerator._strategy.fsdp_plugin
    print("RESULT", accelerator.distributed_type, accelerator.num_processes, plugin.reshard_after_forward,
          float(state["2.bias"][0]), flush=True)
accelerator.end_training()
'''


@pytest.mark.launch
def test_hasten_launch_use_fsdp_runs_a_script_end_to_end(tmp_path):
    import os
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(LAUNCHED_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "hasten.commands.main", "launch", "--cpu", "--num_processes", "2",
                           "--use_fsdp", "--fsdp_reshard_after_forward", "false", str(script)],
                          capture_output=True, text=True, timeout=120, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    assert lines, done.stdout + done.stderr
    _, kind, processes, reshard, bias = lines[0].split()
    assert (kind, processes, reshard) == ("FSDP", "2", "False")
    # The same step in one process on the whole batch.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    model(torch.randn(8, 4, generator=torch.Generator().manual_seed(1))).pow(2).mean().backward()
    assert float(bias) == pytest.approx(float((model[2].bias - 0.1 * model[2].bias.grad)[0].detach()), abs=1e-6)
    assert done.returncode == 0, done.stderr[-2000:]


# ------------------------------------------------- all-or-nothing loads (issue 33): the optimizer too
def _optimizer_of_other_groups(root: str) -> dict:
    from hasten.checkpointing import CheckpointError

    results = {}
    for state_dict_type in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
        accelerator, model, optimizer, scheduler = _prepared(state_dict_type)
        x = torch.randn(4, 6)
        _step(accelerator, model, optimizer, scheduler, x, torch.zeros(4, 1))
        folder = accelerator.save_state(Path(root) / state_dict_type)
        reset_state()
        accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(state_dict_type=state_dict_type,
                                                                             **WRAP_BLOCKS))
        model = make_model(1)  # the same architecture, other weights, two parameter groups
        groups = [{"params": model.head.parameters(), "lr": 0.1},
                  {"params": [p for n, p in model.named_parameters() if not n.startswith("head.")]}]
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(groups, lr=LR))
        _step(accelerator, model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1), x, torch.zeros(4, 1))
        before = _local_shards(model)  # every rank's own shards: each rank is checked, not only rank 0
        try:
            accelerator.load_state(folder)
            results[state_dict_type] = "loaded"
        except CheckpointError as exc:
            results[state_dict_type] = str(exc)
        after = _local_shards(model)
        results[f"unchanged_{state_dict_type}"] = all(torch.equal(before[k], after[k]) for k in before)
    return results


def _local_shards(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
            for name, p in model.named_parameters()}


def test_an_optimizer_of_other_groups_is_refused_before_the_weights_change(tmp_path):
    results = run_on_ranks(_optimizer_of_other_groups, world_size=2, args=(str(tmp_path),), timeout=240)
    assert results[0] == results[1], results
    for kind, where in (("SHARDED_STATE_DICT", "optimizer_0"), ("FULL_STATE_DICT", "optimizer.bin")):
        message = results[0][kind]
        assert where in message and "holds 1 optimizer parameter group(s) but the prepared optimizer has 2" in message, \
            message
        assert results[0][f"unchanged_{kind}"], f"{kind}: the weights changed before the optimizer was refused"
