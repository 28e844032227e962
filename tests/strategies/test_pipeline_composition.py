"""Pipeline parallelism composed with data parallelism on one mesh, over forked gloo ranks: PP2 x FSDP2(2) and
PP2 x DDP2 on 4 processes equal one process on the whole batch over 10 steps (clipped AdamW), and checkpoints
saved under PP x FSDP2 resume on other pipeline sizes and process counts as the uninterrupted run."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from hasten.testing import run_on_ranks

BATCH, STEPS, MAX_NORM = 8, 10, 0.5
SPLITS = {1: None, 2: ["2"], 4: ["1", "2", "4"]}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _data(steps: int = STEPS) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    return torch.randn(steps * BATCH, 8, generator=generator), torch.randn(steps * BATCH, 4, generator=generator)


def _reference(steps: int = STEPS, accumulation: int = 1) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The loop in one process without hasten: per-batch losses and the final weights."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    losses = []
    for index, (x, y) in enumerate(zip(*(tensor.split(BATCH) for tensor in _data(steps)))):
        loss = F.mse_loss(model(x), y)
        (loss / accumulation).backward()
        if (index + 1) % accumulation == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


DATA_PARALLEL = {"dp_shard": {"dp_shard_size": 2}, "dp_replicate": {"dp_replicate_size": 2},
                 "hsdp": {"dp_replicate_size": 2, "dp_shard_size": 2}}


def _composed(dimension: str, accumulation: int, schedule: str = "1F1B"):
    """PP2 x (dp_shard 2 | dp_replicate 2 | both): each data-parallel rank reads its share of every step's batch.
    Under Interleaved1F1B and LoopedBFS each process holds two of four stages."""
    from hasten import Accelerator, ParallelismConfig

    sizes = DATA_PARALLEL[dimension]
    points = SPLITS[4] if schedule in ("Interleaved1F1B", "LoopedBFS") else SPLITS[2]
    config = ParallelismConfig(pp_size=2, pp_microbatches=2, pp_split_points=points, pp_schedule=schedule, **sizes)
    accelerator = Accelerator(parallelism_config=config, cpu=True, gradient_accumulation_steps=accumulation)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    shares = config.data_parallel_size
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_data()), batch_size=BATCH // shares)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader, loss_fn=F.mse_loss)
    losses = []
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = model(x, labels=y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return int(accelerator.torch_device_mesh.get_local_rank("dp")), losses, accelerator.get_state_dict(model)


@pytest.mark.parametrize(("dimension", "accumulation", "world", "schedule"),
                         [("dp_shard", 1, 4, "1F1B"), ("dp_shard", 2, 4, "1F1B"), ("dp_replicate", 1, 4, "1F1B"),
                          ("hsdp", 1, 8, "1F1B"), ("dp_shard", 1, 4, "Interleaved1F1B"),
                          ("dp_shard", 2, 4, "Interleaved1F1B"), ("dp_shard", 1, 4, "LoopedBFS")])
def test_pp2_x_data_parallel_equals_one_process_over_ten_steps(dimension, accumulation, world, schedule):
    """PP2 x FSDP2(2) (also with accumulation 2, and with two stages per process under Interleaved1F1B and
    LoopedBFS),
    PP2 x DDP2, and PP2 x HSDP(2 x 2) on 8 processes."""
    want_losses, want_weights = _reference(accumulation=accumulation)
    results = run_on_ranks(_composed, world_size=world, args=(dimension, accumulation, schedule))
    by_replica: dict[int, list[float]] = {}
    for dp, losses, weights in results:
        by_replica[dp] = losses
        assert sorted(weights) == sorted(want_weights)  # the full model, gathered from the stages' shards
        for name, weight in want_weights.items():
            assert torch.allclose(weights[name], weight, rtol=0, atol=1e-5), (dimension, name)
    mean_losses = [sum(step) / len(step) for step in zip(*by_replica.values())]
    assert len(by_replica) == world // 2 and mean_losses == pytest.approx(want_losses, rel=1e-5)


# ------------------------------------------------------------------------------------------ PP x TP
def _tp_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 16), nn.Tanh(),
                         nn.Linear(16, 4))


TP_PLAN = {"0": "colwise", "2": "rowwise", "4": "colwise", "6": "rowwise"}  # each stage: one colwise/rowwise pair


def _deep_tp_model() -> nn.Module:
    """Four colwise/rowwise pairs: one per stage of four (two stages per process under Interleaved1F1B)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for pair in range(4):
        layers += [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4 if pair == 3 else 8)] + ([nn.Tanh()] if pair < 3 else [])
    return nn.Sequential(*layers)


DEEP_TP_PLAN = {str(index): "colwise" if index % 4 == 0 else "rowwise" for index in range(0, 16, 2)}
#: Per layout: the model, pp_split_points, the tensor-parallel plan and the schedule.
TP_LAYOUTS = {"1F1B": (_tp_model, ["4"], TP_PLAN, "1F1B"),
              "Interleaved1F1B": (_deep_tp_model, ["4", "8", "12"], DEEP_TP_PLAN, "Interleaved1F1B")}


def _pp_tp_loop(layout: str = "1F1B"):
    from hasten import Accelerator, ParallelismConfig
    from hasten.parallelism_config import TorchTensorParallelConfig

    build, points, plan, schedule = TP_LAYOUTS[layout]
    config = ParallelismConfig(pp_size=2, tp_size=2, pp_microbatches=2, pp_split_points=points, pp_schedule=schedule,
                               tp_handler=TorchTensorParallelConfig(tp_plan=plan))
    accelerator = Accelerator(parallelism_config=config, cpu=True)
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_data()), batch_size=BATCH)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader, loss_fn=F.mse_loss)
    losses = []
    for x, y in loader:  # the two tensor-parallel ranks of a stage read the same batch
        loss = model(x, labels=y)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    stage = accelerator.unwrap_model(model)
    split = [name for name, p in stage.named_parameters() if "tp" in (p.device_mesh.mesh_dim_names or ())
             and p.to_local().shape != p.shape]
    return losses, accelerator.get_state_dict(model), split


@pytest.mark.parametrize("layout", ["1F1B", "Interleaved1F1B"])
def test_pp2_x_tp2_equals_one_process_over_ten_steps(layout):
    """One stage per process, and two of four per process under Interleaved1F1B."""
    model = TP_LAYOUTS[layout][0]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    want_losses = []
    for x, y in zip(*(tensor.split(BATCH) for tensor in _data())):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        want_losses.append(loss.item())
    for losses, weights, split in run_on_ranks(_pp_tp_loop, world_size=4, args=(layout,)):
        assert len(split) >= 3  # the stage's colwise weight and bias and rowwise weight are split over tp
        assert losses == pytest.approx(want_losses, rel=1e-5)
        assert sorted(weights) == sorted(model.state_dict())
        for name, weight in model.named_parameters():
            assert torch.allclose(weights[name], weight.detach(), rtol=0, atol=1e-5), name


def _tp_checkpoint(phase: str, folder: str, layout: str = "1F1B"):
    """"save": PP2 x TP2 trains 3 steps and saves; "load": pure PP4 loads. Both return the full weights and
    the next step's loss."""
    from hasten import Accelerator, ParallelismConfig
    from hasten.parallelism_config import TorchTensorParallelConfig

    build, points, plan, schedule = TP_LAYOUTS[layout]
    if phase == "save":
        config = ParallelismConfig(pp_size=2, tp_size=2, pp_microbatches=2, pp_split_points=points,
                                   pp_schedule=schedule, tp_handler=TorchTensorParallelConfig(tp_plan=plan))
    else:
        config = ParallelismConfig(pp_size=4, pp_microbatches=4,
                                   pp_split_points=["2", "4", "6"] if layout == "1F1B" else ["4", "8", "12"])
    accelerator = Accelerator(parallelism_config=config, cpu=True)
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    model, optimizer = accelerator.prepare(model, optimizer, loss_fn=F.mse_loss)
    batches = list(zip(*(tensor.split(BATCH) for tensor in _data(4))))
    if phase == "load":
        accelerator.load_state(folder)
    for x, y in batches[:3] if phase == "save" else []:
        accelerator.backward(model(x, labels=y))
        optimizer.step()
        optimizer.zero_grad()
    if phase == "save":
        accelerator.save_state(folder)
    weights = accelerator.get_state_dict(model)
    loss = model(*batches[3][:1], labels=batches[3][1])
    accelerator.backward(loss)
    optimizer.step()
    return weights, loss.item(), accelerator.get_state_dict(model)


@pytest.mark.parametrize("layout", ["1F1B", "Interleaved1F1B"])
def test_a_pp2_x_tp2_checkpoint_resumes_on_pure_pp4(tmp_path, layout):
    folder = str(tmp_path / "checkpoint")
    saved = run_on_ranks(_tp_checkpoint, world_size=4, args=("save", folder, layout))[0]
    from safetensors.torch import load_file

    from hasten.checkpointing.dcp import merge_sharded_weights

    merged = load_file(merge_sharded_weights(folder, tmp_path / "merged")[0])  # hasten merge-weights, one process
    assert sorted(merged) == sorted(saved[0]) and all(torch.equal(merged[k], v) for k, v in saved[0].items())
    for weights, loss, after in run_on_ranks(_tp_checkpoint, world_size=4, args=("load", folder, layout)):
        assert sorted(weights) == sorted(saved[0])
        for name in saved[0]:
            assert torch.equal(weights[name], saved[0][name]), name
            assert torch.allclose(after[name], saved[2][name], rtol=0, atol=1e-6), name  # optimizer state too
        assert loss == pytest.approx(saved[1], rel=1e-6)


def _unknown_tp_pattern():
    from hasten import Accelerator, ParallelismConfig
    from hasten.exceptions import ConfigurationError
    from hasten.parallelism_config import TorchTensorParallelConfig

    config = ParallelismConfig(pp_size=2, tp_size=2, pp_microbatches=2, pp_split_points=["4"],
                               tp_handler=TorchTensorParallelConfig(tp_plan={**TP_PLAN, "9": "colwise"}))
    accelerator = Accelerator(parallelism_config=config, cpu=True)
    model = _tp_model()
    try:
        accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.mse_loss)
    except ConfigurationError as error:
        return str(error)
    return "no error"


def test_a_tp_pattern_matching_no_module_of_any_stage_is_refused_on_every_process():
    for message in run_on_ranks(_unknown_tp_pattern, world_size=4):
        assert "tp_plan patterns ['9'] match no module of Sequential on any pipeline stage" in message



def _split_backward_over_shards(schedule: str, sizes: dict) -> str:
    from hasten import Accelerator, ParallelismConfig

    config = ParallelismConfig(pp_size=2, pp_schedule=schedule, pp_microbatches=4, pp_split_points=["1", "2", "4"],
                               **sizes)
    accelerator = Accelerator(parallelism_config=config, cpu=True)
    try:
        accelerator.prepare(_model(), loss_fn=F.mse_loss)
    except Exception as error:  # noqa: BLE001 - the message is the result
        return f"{type(error).__name__}: {error}"
    return "no error"


@pytest.mark.parametrize(("schedule", "sizes"), [("ZBVZeroBubble", {"dp_shard_size": 2}),
                                                 ("InterleavedZeroBubble", {"tp_size": 2}),
                                                 ("DualPipeV", {"dp_shard_size": 2})])
def test_split_backward_schedules_with_sharded_stages_are_refused_at_prepare(schedule, sizes):
    """Their weight gradients, computed apart from the backward, are not reduced right by FSDP2/TP stages."""
    for message in run_on_ranks(_split_backward_over_shards, world_size=4, args=(schedule, sizes)):
        assert message.startswith(f"ConfigurationError: pp_schedule={schedule!r} computes weight gradients"), message
        assert "'Interleaved1F1B' or 'LoopedBFS'" in message


# ---------------------------------------------------------------------------------------- checkpoints
CKPT_STEPS, SAVE_AFTER = 6, 2  # save mid-epoch, after the third batch of six


def _layout(world: int, pipeline: int, schedule: str = "1F1B") -> tuple[object, int]:
    """The run's config and each process's rows per batch: pp_size=pipeline, the rest on dp_shard (under
    Interleaved1F1B, two stages per process)."""
    from hasten import ParallelismConfig

    shards = world // pipeline
    if pipeline == 1:
        return ParallelismConfig(dp_shard_size=shards), BATCH // shards
    points = SPLITS[2 * pipeline] if schedule == "Interleaved1F1B" else SPLITS[pipeline]
    return (ParallelismConfig(pp_size=pipeline, dp_shard_size=shards, pp_microbatches=4 // shards,
                              pp_split_points=points, pp_schedule=schedule), BATCH // shards)


def _checkpointed(pipeline: int, phase: str, folder: str, schedule: str = "1F1B"):
    """``phase`` "save": all steps, ``save_state`` after step SAVE_AFTER, ``save_model`` at the end; "load":
    ``load_state`` first (the loader resumes mid-epoch). Returns (data-parallel rank, losses of the steps
    after the save, the full model's weights)."""
    from hasten import Accelerator
    from hasten.state import PartialState

    world = PartialState().num_processes
    config, rows = _layout(world, pipeline, schedule)
    if world == 1:  # FSDP2 on one process (its sharded checkpoints are DCP folders too)
        from hasten import FullyShardedDataParallelPlugin

        accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT"),
                                  cpu=True)
    else:
        accelerator = Accelerator(parallelism_config=config, cpu=True)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_data(CKPT_STEPS)), batch_size=rows)
    extra = {"loss_fn": F.mse_loss} if pipeline > 1 else {}
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader, **extra)
    if phase == "load":
        accelerator.load_state(folder)
    losses = []
    for step, (x, y) in enumerate(loader, start=SAVE_AFTER + 1 if phase == "load" else 0):
        loss = model(x, labels=y) if pipeline > 1 else F.mse_loss(model(x), y)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        if step > SAVE_AFTER:
            losses.append(loss.item())
        if phase.startswith("save") and step == SAVE_AFTER:  # "save-async": written while training goes on
            accelerator.save_state(folder, async_save=phase == "save-async")
    if phase.startswith("save"):
        accelerator.wait_for_checkpoint()
        accelerator.save_model(model, folder + "-model")  # the full model, from every stage's shards
    return accelerator.process_index % (world // pipeline), losses, accelerator.get_state_dict(model)


def _global_losses(results) -> list[float]:
    """Each step's loss over the whole batch: the mean of the data-parallel ranks' losses."""
    by_rank = {dp: losses for dp, losses, _ in results}
    return [sum(step) / len(step) for step in zip(*by_rank.values())]


@pytest.mark.parametrize(("saved_on", "load_on", "save", "schedules"), [
    ((4, 2), (4, 4), "save", ("1F1B", "1F1B")), ((4, 2), (2, 1), "save-async", ("1F1B", "1F1B")),
    ((4, 2), (1, 1), "save", ("1F1B", "1F1B")), ((2, 2), (4, 2), "save", ("1F1B", "1F1B")),
    ((2, 1), (4, 2), "save", ("1F1B", "1F1B")), ((4, 2), (4, 4), "save", ("Interleaved1F1B", "1F1B")),
    ((4, 4), (4, 2), "save", ("1F1B", "Interleaved1F1B"))],
    ids=["pp2xfsdp2-to-pp4", "pp2xfsdp2-async-to-fsdp2", "pp2xfsdp2-to-one-process-fsdp2", "pp2-files-to-pp2xfsdp2",
         "fsdp2-to-pp2xfsdp2", "pp2xfsdp2-interleaved-to-pp4", "pp4-to-pp2xfsdp2-interleaved"])
def test_a_pp2_checkpoint_resumes_mid_epoch_on_another_layout_as_the_uninterrupted_run(saved_on, load_on, save,
                                                                                        schedules, tmp_path):
    """(processes, pp_size), the rest of the processes on dp_shard. PP2 x FSDP2(2) saves one DCP checkpoint
    under the full model's names (once asynchronously), resumed by pure PP4, by FSDP2 without pipeline
    (pp_size 1) on 2 processes and on 1; pure PP2 saves the single-process files, resumed by PP2 x FSDP2(2);
    FSDP2 without pipeline on 2 processes saves DCP, resumed by PP2 x FSDP2(2)."""
    from safetensors.torch import load_file

    from hasten.checkpointing import dcp

    folder = str(tmp_path / "checkpoint")
    saved = run_on_ranks(_checkpointed, world_size=saved_on[0], args=(saved_on[1], save, folder, schedules[0]))
    want_weights = saved[0][2]
    _, reference_weights = _reference(CKPT_STEPS)
    if saved_on[0] > saved_on[1]:  # sharded stages: one DCP checkpoint, the full model's names
        model_keys = sorted(dcp.saved_tensor_shapes(dcp.model_dir(tmp_path / "checkpoint", 0), "model"))
        assert model_keys == sorted(reference_weights)
    written = load_file(os.path.join(folder + "-model", "model.safetensors"))
    assert sorted(written) == sorted(reference_weights)
    for name, weight in reference_weights.items():  # save_model: the single-process model
        assert torch.equal(written[name], want_weights[name]), name
        assert torch.allclose(written[name], weight, rtol=0, atol=1e-5), name
    resumed = run_on_ranks(_checkpointed, world_size=load_on[0], args=(load_on[1], "load", folder, schedules[1]))
    assert _global_losses(resumed) == pytest.approx(_global_losses(saved), rel=1e-6)
    gathered = [weights for _, _, weights in resumed if weights]  # FSDP2 gathers onto the main process only
    assert gathered
    for weights in gathered:
        assert sorted(weights) == sorted(want_weights)
        for name, weight in want_weights.items():
            assert torch.allclose(weights[name], weight, rtol=0, atol=1e-6), name


def _load_into_another_model(folder: str):
    """PP2 x FSDP2(2) with layers of other widths loads a checkpoint of ``_model``: refused, nothing changed."""
    from hasten import Accelerator, ParallelismConfig
    from hasten.exceptions import CheckpointError

    config = ParallelismConfig(pp_size=2, dp_shard_size=2, pp_microbatches=2, pp_split_points=["2"])
    accelerator = Accelerator(parallelism_config=config, cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    model, optimizer = accelerator.prepare(model, optimizer, loss_fn=F.mse_loss)
    before = accelerator.get_state_dict(model)
    try:
        accelerator.load_state(folder)
    except CheckpointError as error:
        after = accelerator.get_state_dict(model)
        return str(error), all(torch.equal(before[name], after[name]) for name in before)
    return "no error", False


def test_a_checkpoint_of_another_model_is_refused_before_anything_is_loaded(tmp_path):
    folder = str(tmp_path / "checkpoint")
    run_on_ranks(_checkpointed, world_size=4, args=(2, "save", folder))
    for message, unchanged in run_on_ranks(_load_into_another_model, world_size=4, args=(folder,)):
        assert "does not match this pipeline stage" in message and "shape mismatches" in message
        assert unchanged
