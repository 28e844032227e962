"""Pipeline-parallel training (``ParallelismConfig(pp_size=2)``) over forked gloo ranks: the ordinary loop
(``loss = model(x, labels=y)``, ``accelerator.backward``, ``clip_grad_norm_``, ``optimizer.step``) gives the
gradients, losses and weights of a single process running the same model on the same data."""

from __future__ import annotations

import os
import re
import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from hasten.testing import run_on_ranks

BATCH, STEPS, MAX_NORM = 8, 3, 0.5


class _WithOwnLoss(nn.Module):
    """A model that returns its own mean loss when given labels (the pipeline's last stage computes it)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        out = self.body(x)
        return out if labels is None else F.mse_loss(out, labels)


def _model(own_loss: bool) -> nn.Module:
    torch.manual_seed(0)
    if own_loss:
        return _WithOwnLoss()
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 8, generator=generator), torch.randn(BATCH, 4, generator=generator))
            for _ in range(STEPS)]


def _reference(own_loss: bool, clip: bool):
    """The same loop in one process, without hasten: (first step's gradients, losses, final weights, norms)."""
    model = _model(own_loss)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    grads, losses, norms = {}, [], []
    for step, (x, y) in enumerate(_data()):
        loss = model(x, labels=y) if own_loss else F.mse_loss(model(x), y)
        loss.backward()
        if step == 0:
            grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return grads, losses, {name: p.detach().clone() for name, p in model.named_parameters()}, norms


def _pipelined(schedule: str, own_loss: bool, clip: bool):
    from hasten import Accelerator, ParallelismConfig

    model = _model(own_loss)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    points = ["body.2"] if own_loss else ["2"]
    config = ParallelismConfig(pp_size=2, pp_schedule=schedule, pp_microbatches=4, pp_split_points=points)
    accelerator = Accelerator(parallelism_config=config, cpu=True)
    if own_loss:
        model, optimizer = accelerator.prepare(model, optimizer)
    else:
        model, optimizer = accelerator.prepare(model, optimizer, loss_fn=F.mse_loss)
    grads, losses, norms = {}, [], []
    for step, (x, y) in enumerate(_data()):
        loss = model(x, labels=y)
        accelerator.backward(loss)
        if step == 0:
            grads = {name: p.grad.clone() for name, p in accelerator.unwrap_model(model).named_parameters()}
        if clip:
            norms.append(float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    weights = {name: p.detach().clone() for name, p in accelerator.unwrap_model(model).named_parameters()}
    return grads, losses, weights, norms


def _merged(results):
    """Every stage's gradients/weights under their full-model names (each name on exactly one stage)."""
    grads, weights = {}, {}
    for rank_grads, _, rank_weights, _ in results:
        assert not set(rank_grads) & set(grads)
        grads.update(rank_grads)
        weights.update(rank_weights)
    return grads, weights


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_pp2_gradients_losses_and_clipped_weights_equal_one_process(schedule):
    want_grads, want_losses, want_weights, want_norms = _reference(own_loss=False, clip=True)
    results = run_on_ranks(_pipelined, world_size=2, args=(schedule, False, True))
    grads, weights = _merged(results)
    assert set(grads) == set(want_grads) and set(weights) == set(want_weights)
    for name, grad in want_grads.items():
        assert torch.allclose(grads[name], grad, rtol=0, atol=1e-6), name
    for _, losses, _, norms in results:  # the loss and the norm over both stages, on every process
        assert losses == pytest.approx(want_losses, rel=1e-6)
        assert norms == pytest.approx(want_norms, rel=1e-5)
    assert all(n > MAX_NORM for n in want_norms[:1])  # the clip did act
    for name, weight in want_weights.items():
        assert torch.allclose(weights[name], weight, rtol=0, atol=1e-6), name


def test_pp2_with_the_models_own_loss_equals_one_process():
    want_grads, want_losses, want_weights, _ = _reference(own_loss=True, clip=False)
    results = run_on_ranks(_pipelined, world_size=2, args=("1F1B", True, False))
    grads, weights = _merged(results)
    assert sorted(grads) == sorted(want_grads)
    for name, grad in want_grads.items():
        assert torch.allclose(grads[name], grad, rtol=0, atol=1e-6), name
    for _, losses, _, _ in results:
        assert losses == pytest.approx(want_losses, rel=1e-6)
    for name, weight in want_weights.items():
        assert torch.allclose(weights[name], weight, rtol=0, atol=1e-6), name


# ------------------------------------------------------------------------------------------ refusals
def test_pipeline_fields_come_from_the_launch_block_and_bad_ones_are_refused():
    from hasten import ParallelismConfig
    from hasten.config.parallelism import resolve_parallelism_config
    from hasten.exceptions import ConfigurationError

    block = {"parallelism_config_pp_size": 2, "parallelism_config_pp_schedule": "GPipe",
             "parallelism_config_pp_microbatches": "4", "parallelism_config_pp_split_points": "body.2, body.4"}
    config = resolve_parallelism_config(ParallelismConfig(), launch_block=block, num_processes=2)
    assert (config.pp_size, config.pp_schedule, config.pp_microbatches, config.pp_split_points) == (
        2, "GPipe", 4, ["body.2", "body.4"])
    assert config.mesh_dim_names == ["pp", "dp_shard"] and config.data_parallel_size == 1
    # pp_microbatches left unset follows the pp_size the launch fills in (pp_size micro-batches)
    config = resolve_parallelism_config(ParallelismConfig(), launch_block={"parallelism_config_pp_size": "4"},
                                        num_processes=4)
    assert (config.pp_size, config.pp_microbatches, config.pipeline_microbatches) == (4, None, 4)
    with pytest.raises(ConfigurationError, match="pp_microbatches=1 is fewer than pp_size=2"):
        ParallelismConfig(pp_size=2, pp_microbatches=1)
    ParallelismConfig(pp_size=2, dp_shard_size=2).validate(4)  # PP x FSDP2 (tests/strategies/test_pipeline_composition)
    ParallelismConfig(pp_size=2, tp_size=2).validate(4)  # PP x TP (tests/strategies/test_pipeline_composition)
    with pytest.raises(ConfigurationError, match="not with context parallelism"):
        ParallelismConfig(pp_size=2, cp_size=2).validate(4)


def _refusal(case: str, folder: str):
    from hasten import Accelerator, ParallelismConfig
    from hasten.exceptions import CheckpointError, ConfigurationError

    points = None if case == "no split points" else ["2"]
    config = ParallelismConfig(pp_size=2, pp_microbatches=4, pp_split_points=points)
    accelerator = Accelerator(parallelism_config=config, cpu=True,
                              gradient_accumulation_steps=2 if case == "mid-window save" else 1,
                              dynamo_backend="eager" if case == "dynamo" else None)
    model = _model(own_loss=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(12, 8), torch.zeros(12, 4)),
                                         batch_size=6 if case == "loader batch" else 4)
    started = time.monotonic()
    try:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader, loss_fn=F.mse_loss)
        if case == "call batch":
            model(torch.zeros(6, 8), labels=torch.zeros(6, 4))
        elif case == "foreign loss":
            x, y = next(iter(loader))
            model(x, labels=y)
            accelerator.backward(torch.tensor(1.0, requires_grad=True))
        elif case == "mid-window save":
            x, y = next(iter(loader))
            with accelerator.accumulate(model):
                accelerator.backward(model(x, labels=y))
            accelerator.save_state(folder)
    except (ConfigurationError, CheckpointError) as error:
        assert not os.path.exists(folder)  # nothing half-written
        return str(error), time.monotonic() - started
    return "no error", time.monotonic() - started


@pytest.mark.serial
@pytest.mark.parametrize(("case", "message"), [
    ("no split points", "has no split points: pass ParallelismConfig(pp_size=2, pp_split_points=[...])"),
    ("loader batch", "A batch of 6 rows does not split into pp_microbatches=4"),
    ("call batch", "A batch of 6 rows does not split into pp_microbatches=4"),
    ("foreign loss", "takes exactly the loss that call returned"),
    ("mid-window save", "save_state inside an accumulation window is not available under pp_size > 1"),
    ("dynamo", "dynamo_backend='eager' under pp_size > 1 is not available yet"),
])
def test_refusals_are_one_clear_error_on_every_process_within_5_s(case, message, tmp_path):
    results = run_on_ranks(_refusal, world_size=2, args=(case, str(tmp_path / "checkpoint")))
    for text, seconds in results:
        assert message in text
        assert seconds < 5


# -------------------------------------------------------------------- the loop with a prepared loader
SPLITS = {2: ["2"], 4: ["1", "2", "4"]}


def _loader_data():
    generator = torch.Generator().manual_seed(2)
    return torch.randn(4 * BATCH, 8, generator=generator), torch.randn(4 * BATCH, 4, generator=generator)


def _reference_accumulated(accumulation: int):
    model = _model(own_loss=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # SGD: the gradients' scale shows in the weights
    inputs, labels = _loader_data()
    losses = []
    for index, (x, y) in enumerate(zip(inputs.split(BATCH), labels.split(BATCH))):
        loss = F.mse_loss(model(x), y)
        (loss / accumulation).backward()
        if (index + 1) % accumulation == 0:
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def _pipelined_loop(schedule: str, accumulation: int):
    from hasten import Accelerator, ParallelismConfig
    from hasten.state import PartialState

    world = PartialState().num_processes
    config = ParallelismConfig(pp_size=world, pp_schedule=schedule, pp_microbatches=4, pp_split_points=SPLITS[world])
    accelerator = Accelerator(parallelism_config=config, cpu=True, gradient_accumulation_steps=accumulation)
    model = _model(own_loss=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_loader_data()), batch_size=BATCH)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader, loss_fn=F.mse_loss)
    losses = []
    for x, y in loader:  # every stage reads the same batches (the pipeline is not a data-parallel axis)
        with accelerator.accumulate(model):
            loss = model(x, labels=y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    weights = {name: p.detach().clone() for name, p in accelerator.unwrap_model(model).named_parameters()}
    return losses, weights


@pytest.mark.parametrize(("world_size", "schedule", "accumulation"), [(2, "1F1B", 2), (4, "GPipe", 1)])
def test_a_prepared_loader_with_accumulation_and_four_stages_equals_one_process(world_size, schedule, accumulation):
    want_losses, want_weights = _reference_accumulated(accumulation)
    results = run_on_ranks(_pipelined_loop, world_size=world_size, args=(schedule, accumulation))
    weights = {}
    for losses, rank_weights in results:
        assert losses == pytest.approx(want_losses, rel=1e-6)
        weights.update(rank_weights)
    assert sorted(weights) == sorted(want_weights)
    for name, weight in want_weights.items():
        assert torch.allclose(weights[name], weight, rtol=0, atol=1e-6), name


# ------------------------------------------------------------------------------------------ launch
LAUNCHED_SCRIPT = """
import torch
from torch import nn
from torch.nn import functional as F
from hasten import Accelerator, ParallelismConfig

accelerator = Accelerator(parallelism_config=ParallelismConfig())  # the sizes come from hasten launch
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer, loss_fn=F.mse_loss)
generator = torch.Generator().manual_seed(1)
for _ in range(3):
    loss = model(torch.randn(8, 8, generator=generator), labels=torch.randn(8, 4, generator=generator))
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
config = accelerator.parallelism_config
print(f"rank={accelerator.process_index} pp={config.pp_size} schedule={config.pp_schedule} "
      f"microbatches={config.pp_microbatches} loss={loss.item():.9g}", flush=True)
"""


@pytest.mark.launch
def test_hasten_launch_pp_flags_train_the_script_unchanged(tmp_path):
    import subprocess
    import sys

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        loss = F.mse_loss(model(torch.randn(8, 8, generator=generator)), torch.randn(8, 4, generator=generator))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    (tmp_path / "train.py").write_text(LAUNCHED_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", HASTEN_HOME=str(tmp_path / "home"))
    env.pop("HASTEN_LAUNCH_CONFIG", None)
    done = subprocess.run([sys.executable, "-m", "hasten.commands.main", "launch", "--cpu",
                           "--parallelism_config_pp_size", "2", "--parallelism_config_pp_split_points", "2",
                           "--parallelism_config_pp_schedule", "GPipe", "--parallelism_config_pp_microbatches", "4",
                           "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    # the two workers share the pipe: a line's text and its newline are separate writes that may interleave
    lines = sorted(re.findall(r"rank=\d+ pp=\S+ schedule=\S+ microbatches=\S+ loss=[-+0-9.e]+?(?=rank=|\s|$)",
                              done.stdout))
    assert [line.split(" loss=")[0] for line in lines] == [
        f"rank={rank} pp=2 schedule=GPipe microbatches=4" for rank in (0, 1)]
    for line in lines:
        assert float(line.split(" loss=")[1]) == pytest.approx(loss.item(), rel=1e-6)


# ------------------------------------------------------------------------------------------ splitting
def test_a_stage_keeps_the_full_models_names_and_bad_split_points_are_refused():
    from hasten.exceptions import ConfigurationError
    from hasten.strategies.pipeline_split import SkippedModule, cut_stage

    full = sorted(_model(own_loss=True).state_dict())
    stages = [cut_stage(_model(own_loss=True), ["body.2", "body.4"], index) for index in range(3)]
    keys = [sorted(stage.state_dict()) for stage in stages]
    assert keys == [["body.0.bias", "body.0.weight"], ["body.2.bias", "body.2.weight"],
                    ["body.4.bias", "body.4.weight"]]
    assert sorted(sum(keys, [])) == full
    assert isinstance(stages[0].body[2], SkippedModule) and isinstance(stages[2].body[1], SkippedModule)
    x = torch.randn(3, 8)
    with torch.no_grad():  # the stages chained are the full model
        assert torch.equal(stages[2](stages[1](stages[0](x))), _model(own_loss=True)(x))
    for points, message in [(["body.9"], "is not a module"), (["body.4", "body.2"], "not in the model's order"),
                            (["body.0"], "stage 0 would be empty"), (["body"], "is the model's first module"),
                            (["body.2", "body.2.weight"], "is not a module")]:
        with pytest.raises(ConfigurationError, match=message):
            cut_stage(_model(own_loss=True), points, 0, len(points) + 1)
    with pytest.raises(ConfigurationError, match="needs 1 split points"):
        cut_stage(_model(own_loss=True), [], 0, 2)
    owner = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    owner.register_parameter("scale", nn.Parameter(torch.ones(2)))
    with pytest.raises(ConfigurationError, match=r"owns \['scale'\] directly"):
        cut_stage(owner, ["1"], 0, 2)


def test_prepare_refuses_a_loss_fn_without_pipeline_parallelism():
    from hasten import Accelerator
    from hasten.exceptions import ConfigurationError
    from hasten.state import reset_state

    reset_state()
    accelerator = Accelerator(cpu=True)
    with pytest.raises(ConfigurationError, match="loss_fn=...\\) is for pipeline-parallel runs"):
        accelerator.prepare(_model(own_loss=False), loss_fn=F.mse_loss)
    reset_state()


# ------------------------------------------------------------------------------------- PP x DDP
def _pp_ddp_loop():
    from hasten import Accelerator, ParallelismConfig

    config = ParallelismConfig(pp_size=2, dp_replicate_size=2, pp_microbatches=2, pp_split_points=["2"])
    accelerator = Accelerator(parallelism_config=config, cpu=True)
    model = _model(own_loss=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs, labels = _loader_data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, labels), batch_size=BATCH // 2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader, loss_fn=F.mse_loss)
    losses = []
    for x, y in loader:
        loss = model(x, labels=y)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    mesh = accelerator.torch_device_mesh
    weights = {name: p.detach().clone() for name, p in accelerator.unwrap_model(model).named_parameters()}
    return int(mesh.get_local_rank("pp")), int(mesh.get_local_rank("dp_replicate")), losses, weights


def test_pp2_x_ddp2_equals_one_process_on_the_whole_batch():
    """Each replica reads half of every step's batch; the step equals one process on the whole batch."""
    model = _model(own_loss=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs, labels = _loader_data()
    want_losses = []
    for x, y in zip(inputs.split(BATCH), labels.split(BATCH)):  # the two replicas' halves of one step
        loss = F.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        want_losses.append(loss.item())
    results = run_on_ranks(_pp_ddp_loop, world_size=4)
    assert sorted((pp, dp) for pp, dp, _, _ in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    by_replica = {dp: losses for _, dp, losses, _ in results}
    mean_losses = [(a + b) / 2 for a, b in zip(by_replica[0], by_replica[1])]
    assert mean_losses == pytest.approx(want_losses, rel=1e-6)
    for dp in (0, 1):
        weights = {}
        for _, replica, _, rank_weights in results:
            if replica == dp:
                weights.update(rank_weights)
        assert sorted(weights) == sorted(model.state_dict())
        for name, weight in model.named_parameters():
            assert torch.allclose(weights[name], weight.detach(), rtol=0, atol=1e-6), (dp, name)


# ------------------------------------------------------------- other batch shapes, and evaluation
def _shapes_and_evaluation():
    from hasten import Accelerator, ParallelismConfig

    config = ParallelismConfig(pp_size=2, pp_microbatches=2, pp_split_points=["2"])
    accelerator = Accelerator(parallelism_config=config, cpu=True)
    model = _model(own_loss=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer, loss_fn=F.mse_loss)
    generator = torch.Generator().manual_seed(3)
    results = []
    for rows in (8, 4, 12, 8):  # a new shape gets its own stage buffers; the first shape again reuses them
        x, y = torch.randn(rows, 8, generator=generator), torch.randn(rows, 4, generator=generator)
        loss = model(x, labels=y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        results.append(loss.item())
    model.eval()
    x, y = torch.randn(6, 8, generator=generator), torch.randn(6, 4, generator=generator)
    with torch.no_grad():
        outputs = model(x)
        eval_loss = model(x, labels=y)
    model.train()
    return results, outputs, eval_loss.item()


def test_batches_of_other_sizes_and_evaluation_equal_one_process():
    model = _model(own_loss=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(3)
    want = []
    for rows in (8, 4, 12, 8):
        x, y = torch.randn(rows, 8, generator=generator), torch.randn(rows, 4, generator=generator)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        want.append(loss.item())
    x, y = torch.randn(6, 8, generator=generator), torch.randn(6, 4, generator=generator)
    with torch.no_grad():
        want_outputs = model(x)
        want_eval_loss = F.mse_loss(want_outputs, y).item()
    for losses, outputs, eval_loss in run_on_ranks(_shapes_and_evaluation, world_size=2):
        assert losses == pytest.approx(want, rel=1e-6)
        assert torch.allclose(outputs, want_outputs, rtol=0, atol=1e-6)  # on every process
        assert eval_loss == pytest.approx(want_eval_loss, rel=1e-6)


# ---------------------------------------------------------------------------------------- checkpoints
def _checkpointed(phase: str, folder: str):
    """pp_size = the number of processes (1: no pipeline). "save": steps 0-1, save, steps 2-3; "load": load, 2-3.
    Returns the full model's weights (gathered from the stages) and the losses of steps 2-3."""
    from hasten import Accelerator, ParallelismConfig
    from hasten.state import PartialState

    world = PartialState().num_processes
    pipelined = world > 1
    config = ParallelismConfig(pp_size=world, pp_microbatches=4, pp_split_points=SPLITS[world]) if pipelined else None
    accelerator = Accelerator(parallelism_config=config, cpu=True)
    model = _model(own_loss=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    extra = {"loss_fn": F.mse_loss} if pipelined else {}
    model, optimizer = accelerator.prepare(model, optimizer, **extra)
    batches = list(zip(*(tensor.split(BATCH) for tensor in _loader_data())))
    if phase == "load":
        accelerator.load_state(folder)
    losses = []
    for step, (x, y) in enumerate(batches):
        if phase == "load" and step < 2:
            continue
        loss = model(x, labels=y) if pipelined else F.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step >= 2:
            losses.append(loss.item())
        if phase == "save" and step == 1:
            accelerator.save_state(folder)
    if phase == "save":
        accelerator.save_model(model, folder + "-model")  # the full model, from every stage
    return accelerator.get_state_dict(model), losses


@pytest.mark.parametrize(("save_on", "load_on"), [(2, 1), (2, 4), (1, 2)])
def test_a_checkpoint_resumes_on_another_pp_size_as_the_uninterrupted_run(save_on, load_on, tmp_path):
    folder = str(tmp_path / "checkpoint")
    want_weights, want_losses = run_on_ranks(_checkpointed, world_size=save_on, args=("save", folder))[0]
    from safetensors.torch import load_file

    saved_model = load_file(os.path.join(folder + "-model", "model.safetensors"))
    assert sorted(saved_model) == sorted(want_weights)
    assert all(torch.equal(saved_model[name], weight) for name, weight in want_weights.items())
    for weights, losses in run_on_ranks(_checkpointed, world_size=load_on, args=("load", folder)):
        assert losses == pytest.approx(want_losses, rel=1e-6)
        assert sorted(weights) == sorted(want_weights)
        for name, weight in want_weights.items():
            assert torch.allclose(weights[name], weight, rtol=0, atol=1e-6), name


def _resumed_from_a_plain_optimizer_state(folder: str):
    """Steps 2-3 under pp_size=2 from one process's plain ``model.state_dict()`` and ``optimizer.state_dict()``
    after steps 0-1, loaded as transformers' Trainer does: the weights into the model before ``prepare``, the
    optimizer's through the prepared optimizer's ``load_state_dict``."""
    from hasten import Accelerator, ParallelismConfig

    accelerator = Accelerator(parallelism_config=ParallelismConfig(pp_size=2, pp_microbatches=4,
                                                                   pp_split_points=SPLITS[2]), cpu=True)
    model = _model(own_loss=False)
    model.load_state_dict(torch.load(os.path.join(folder, "model.pt")))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer, loss_fn=F.mse_loss)
    optimizer.load_state_dict(torch.load(os.path.join(folder, "optimizer.pt")))
    for x, y in list(zip(*(tensor.split(BATCH) for tensor in _loader_data())))[2:]:
        accelerator.backward(model(x, labels=y))
        optimizer.step()
        optimizer.zero_grad()
    return accelerator.get_state_dict(model)


def test_a_plain_optimizer_state_of_the_full_model_loads_onto_each_stage(tmp_path):
    """One process's ``optimizer.state_dict()`` (what Trainer saves without pipeline parallelism), loaded
    through the prepared optimizer under pp_size=2, lands on each stage's parameters: the resumed run ends
    with the uninterrupted one-process run's weights."""
    model = _model(own_loss=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    for step, (x, y) in enumerate(zip(*(tensor.split(BATCH) for tensor in _loader_data()))):
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 1:
            torch.save(model.state_dict(), tmp_path / "model.pt")
            torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")
    for weights in run_on_ranks(_resumed_from_a_plain_optimizer_state, world_size=2, args=(str(tmp_path),)):
        assert sorted(weights) == sorted(model.state_dict())
        for name, weight in model.state_dict().items():
            assert torch.allclose(weights[name], weight, rtol=0, atol=1e-6), name


def _two_stages_after_one_step():
    """pp_size=2 over the test model, prepared and stepped once: (accelerator, model, optimizer, one batch)."""
    from hasten import Accelerator, ParallelismConfig

    config = ParallelismConfig(pp_size=2, pp_microbatches=2, pp_split_points=["2"])
    accelerator = Accelerator(parallelism_config=config, cpu=True)
    model = _model(own_loss=False)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.05), loss_fn=F.mse_loss)
    x, y = _data()[0]
    accelerator.backward(model(x, labels=y))
    optimizer.step()
    return accelerator, model, optimizer, (x, y)


def _stages_a_step_apart():
    """Rank 1 steps its optimizer once more on its own; the main process then asks for the state after its step."""
    from hasten.exceptions import CheckpointError

    accelerator, _model_, optimizer, _batch = _two_stages_after_one_step()
    if accelerator.process_index == 1:
        optimizer.step()
    torch.distributed.barrier()
    outcome: list = []
    if accelerator.is_main_process:
        try:
            optimizer.state_dict()
        except CheckpointError as error:
            outcome.append(str(error))
        optimizer.step()  # the stages agree again: the service still answers
        outcome.append(sorted(optimizer.state_dict()["state"]))
    return outcome


def test_the_main_process_reading_a_stage_at_another_step_gets_a_clear_error_and_the_service_goes_on():
    outcome = run_on_ranks(_stages_a_step_apart, world_size=2)
    assert outcome[1] == []
    message, indices = outcome[0]
    assert "rank 1" in message and "at optimizer step 2, past the main process's 1" in message, message
    assert indices == [0, 1, 2, 3, 4, 5]  # every parameter of the full model (both stages')


def test_a_state_snapshot_waits_for_its_step_within_the_bound():
    import threading
    from datetime import timedelta

    from hasten.exceptions import CheckpointError
    from hasten.strategies.pipeline_state_service import StepClock

    clock, parameter = StepClock(), nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([parameter], lr=1.0)
    clock.watch(optimizer)
    with pytest.raises(CheckpointError, match="did not reach optimizer step 1 within 0.2 s"):
        clock.snapshot_at(1, lambda: None, timedelta(seconds=0.2))
    parameter.grad = torch.ones(2)
    stepper = threading.Thread(target=optimizer.step)
    stepper.start()
    # taken after the whole step, never inside it
    assert clock.snapshot_at(1, lambda: (clock.steps, parameter.detach().clone()), timedelta(seconds=30))[1].eq(0).all()
    stepper.join()


def _stage_one_fails():
    """Rank 1 raises after one step; the main process then runs a step that needs it."""
    accelerator, model, _optimizer, (x, y) = _two_stages_after_one_step()
    if accelerator.process_index == 1:
        raise RuntimeError("stage 1 failed on purpose")
    accelerator.backward(model(x, labels=y))


@pytest.mark.serial
def test_a_failing_stage_does_not_wait_for_the_state_server_to_be_stopped():
    """A non-main stage waits at its end for the main process to stop its state server, but not when it
    ends because of an error: it leaves at once, and the main process's pending step fails, well within
    the collective bound (120 s here) and the process group's timeout (60 s)."""
    from hasten.testing import RankFailed

    start = time.monotonic()
    with pytest.raises(RankFailed, match="stage 1 failed on purpose"):
        run_on_ranks(_stage_one_fails, world_size=2, env={"HASTEN_COLLECTIVE_TIMEOUT": "120"}, timeout=110)
    assert time.monotonic() - start < 40
