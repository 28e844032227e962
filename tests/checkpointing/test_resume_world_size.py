"""Resume on another number of processes, mid-epoch (issue 24, items 3-4).

Ground truth: the uninterrupted run on the saving number of processes. A run saved mid-epoch on N
processes and resumed on M, with the global batch kept (per-process batch x processes x accumulation),
must use the same samples in every later optimizer step (so the same set of samples overall) and end
with the same weights (within 1e-5: only the order of the float reductions differs), for DDP, FSDP2
with sharded (DCP) checkpoints (saved with ``async_save=True``), an HSDP 2x2 mesh resumed on FSDP2
over 3 processes, and DeepSpeed ZeRO-2 and ZeRO-3 (converted to DeepSpeed's universal checkpoint on load).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator
from hasten.config.plugins.fsdp import FullyShardedDataParallelPlugin
from hasten.parallelism_config import ParallelismConfig
from hasten.testing import preload_deepspeed, run_on_ranks
from hasten.utils import set_seed

GLOBAL_BATCH, SAMPLES, EPOCHS, SAVE_AT = 12, 72, 2, 2  # 6 steps per epoch; save after step 2 of epoch 0
ATOL = 1e-5


def _accelerator(kind: str, world: int, accumulation: int) -> Accelerator:
    if kind == "ddp":
        return Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    if kind == "fsdp2":
        return Accelerator(cpu=True, gradient_accumulation_steps=accumulation,
                           fsdp_plugin=FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT"))
    if kind == "deepspeed":
        from hasten.config.plugins.deepspeed import DeepSpeedPlugin

        return Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2), gradient_accumulation_steps=accumulation)
    if kind == "zero3":
        from hasten.config.plugins.deepspeed import DeepSpeedPlugin

        return Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=3), gradient_accumulation_steps=accumulation)
    if kind == "hsdp":
        return Accelerator(cpu=True, parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2))
    assert kind == "fsdp2-mesh"
    return Accelerator(cpu=True, parallelism_config=ParallelismConfig(dp_shard_size=world))


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(SAMPLES, 6, generator=g)
    return TensorDataset(x, torch.sin(x.sum(1, keepdim=True)), torch.arange(SAMPLES))


def _train(kind: str, accumulation: int, folder: str, resume: bool) -> tuple[list[list[int]], dict]:
    """Train to the end of epoch 1; save after SAVE_AT steps, or start from that checkpoint.

    Returns (sorted sample ids of every optimizer step after the save point, final full weights).
    """
    world = torch.distributed.get_world_size()
    accelerator = _accelerator(kind, world, accumulation)
    dp = accelerator._data_parallel_position()[0]
    per_process = GLOBAL_BATCH // (dp * accumulation)
    set_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    groups: list = [{"params": model.parameters()}]
    if kind == "zero3":  # two groups with their own hyperparameters: each must come back as saved
        groups = [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.01, "weight_decay": 0}]
    optimizer = torch.optim.AdamW(groups, lr=0.02)
    loader = DataLoader(_data(), batch_size=per_process, shuffle=True)
    set_seed(100 + world)  # the shuffling seed is drawn here: a resumed run must get its order from the checkpoint
    # A decaying schedule (not under DeepSpeed, whose engine owns schedules): Accelerate steps it once per
    # process per optimizer step, so a resume on another count must keep the saved rate to follow the same
    # learning rates.
    scheduler = None if kind in ("deepspeed", "zero3") else torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + 0.2 * s))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    if resume:
        accelerator.load_state(folder)
    steps: list[list[int]] = []
    window: list[int] = []
    done = SAVE_AT if resume else 0
    for _epoch in range(loader.state_dict()["epoch"], EPOCHS):
        for x, y, ids in loader:
            with accelerator.accumulate(model):
                accelerator.backward(nn.functional.mse_loss(model(x), y))
                optimizer.step()
                if scheduler is not None:
                    scheduler.step()
                optimizer.zero_grad()
            window += accelerator.gather(ids).tolist()
            if accelerator.sync_gradients:
                done += 1
                if done > SAVE_AT:
                    steps.append(sorted(window))
                window = []
                if done == SAVE_AT and not resume:
                    # Sharded (DCP) checkpoints are saved asynchronously: training goes on while they
                    # are written, so the resumed runs also check that they hold the state of the call.
                    accelerator.save_state(folder, async_save=kind in ("fsdp2", "hsdp"))
    accelerator.wait_for_checkpoint()
    weights = {k: v.detach().float().clone() for k, v in accelerator.get_state_dict(model).items()}
    return steps, weights


_saved: dict[tuple[str, int, int], tuple[Path, tuple[list[list[int]], dict]]] = {}


def _uninterrupted(tmp_path_factory: pytest.TempPathFactory, kind: str, world: int,
                   accumulation: int) -> tuple[Path, tuple[list[list[int]], dict]]:
    """The run on the saving count (it saves at SAVE_AT and goes on): shared by the cases that resume it."""
    key = (kind, world, accumulation)
    if key not in _saved:
        folder = tmp_path_factory.mktemp(f"{kind}-{world}") / "ckpt"
        result = run_on_ranks(_train, world_size=world, args=(kind, accumulation, str(folder), False), timeout=300)
        _saved[key] = (folder, result[0])
    return _saved[key]


@pytest.mark.parametrize(("saved_kind", "saved_on", "saved_accumulation", "kind", "resumed_on", "accumulation"), [
    ("ddp", 2, 1, "ddp", 4, 1),
    ("ddp", 4, 1, "ddp", 2, 1),
    ("ddp", 2, 1, "ddp", 3, 1),
    ("ddp", 2, 2, "ddp", 4, 1),  # accumulation 2 -> 1: the global batch is kept by the process count
    ("fsdp2", 2, 1, "fsdp2", 4, 1),
    ("fsdp2", 4, 1, "fsdp2", 2, 1),
    ("fsdp2", 2, 1, "fsdp2", 3, 1),
    ("hsdp", 4, 1, "fsdp2-mesh", 3, 1),  # a 2x2 mesh (replicate x shard) onto a 1-D one of 3
    ("deepspeed", 2, 1, "deepspeed", 4, 1),  # ZeRO-2 shards, through DeepSpeed's universal checkpoint
    ("zero3", 2, 1, "zero3", 3, 1),  # ZeRO-3 (parameters sharded too; two parameter groups), the same way
])
def test_mid_epoch_resume_on_another_count_equals_the_uninterrupted_run(
        tmp_path_factory, saved_kind, saved_on, saved_accumulation, kind, resumed_on, accumulation):
    if kind in ("deepspeed", "zero3"):
        preload_deepspeed()  # once in the parent: the forked ranks start without paying for it
    folder, (full_steps, full_weights) = _uninterrupted(tmp_path_factory, saved_kind, saved_on, saved_accumulation)
    steps, weights = run_on_ranks(_train, world_size=resumed_on, args=(kind, accumulation, str(folder), True),
                                  timeout=300)[0]
    assert len(full_steps) == EPOCHS * SAMPLES // GLOBAL_BATCH - SAVE_AT
    assert steps == full_steps  # every later optimizer step used the same samples
    assert sorted(i for s in steps for i in s) == sorted(i for s in full_steps for i in s)
    assert weights.keys() == full_weights.keys()
    for key in weights:
        assert torch.allclose(weights[key], full_weights[key], rtol=0, atol=ATOL), key


def test_zero_shards_of_another_count_are_planned_for_conversion_and_same_count_ones_are_not(tmp_path):
    from types import SimpleNamespace

    from hasten.strategies.deepspeed import DeepSpeedStrategy

    sub = tmp_path / "pytorch_model"
    sub.mkdir()
    for name in ("zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                 "zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        torch.save({"module": {}} if "model_states" in name else {}, sub / name)

    def strategy(stage: int, processes: int) -> SimpleNamespace:
        engine = SimpleNamespace(zero_optimization=lambda: True, zero_optimization_stage=lambda: stage,
                                 module=torch.nn.Module(), optimizer=None)  # the checks against the model pass
        return SimpleNamespace(num_processes=processes, _engines=lambda models: [("pytorch_model", engine)])

    for stage in (1, 2, 3):
        assert DeepSpeedStrategy.check(strategy(stage, 4), [], [], tmp_path).models == {"pytorch_model": 2}  # type: ignore[arg-type]
        assert DeepSpeedStrategy.check(strategy(stage, 2), [], [], tmp_path).models == {}  # type: ignore[arg-type]


def _dispatched(root: str, save: bool) -> list[int]:
    from hasten.utils import DataLoaderConfiguration

    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    loader = accelerator.prepare(DataLoader(torch.arange(48), batch_size=12 // accelerator.num_processes,
                                            shuffle=True))
    if not save:
        accelerator.load_state(Path(root) / "ck")
    seen: list[int] = []
    for i, batch in enumerate(loader):
        seen += accelerator.gather(batch).tolist()
        if save and i == 1:
            accelerator.save_state(Path(root) / "ck")
            break
    return seen


def test_a_dispatching_loader_continues_on_another_count(tmp_path):
    seen = run_on_ranks(_dispatched, world_size=2, args=(str(tmp_path), True))[0]
    rest = run_on_ranks(_dispatched, world_size=4, args=(str(tmp_path), False))[0]
    assert len(seen) == 24 and sorted(seen + rest) == list(range(48))
