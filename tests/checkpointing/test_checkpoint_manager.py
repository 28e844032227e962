"""``CheckpointManager`` driven without an ``Accelerator`` (issue 24, item 1): the protocol's one owner
is given the objects and the strategy, and needs nothing else.

Ground truths: the states taken at save time (weights, optimizer, scheduler, registered object, the
step counter and the generators' next draws), the manifest's file list and process count, and the
set of files the save's sealed sink was handed (every file the manager and the strategy wrote, none left
to the atomic fallback).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from hasten.base.dataclasses import DistributedType
from hasten.checkpointing import CheckpointError
from hasten.checkpointing.manager import CheckpointManager, Ranks, TrainingObjects
from hasten.checkpointing.sinks import SealedSink
from hasten.precision import Precision
from hasten.strategies.base import Strategy
from hasten.testing import run_on_ranks


class Counter:
    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


def _objects() -> TrainingObjects:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return TrainingObjects(models=[model], optimizers=[optimizer], schedulers=[scheduler], custom_objects=[Counter()])


def _train(objects: TrainingObjects) -> None:
    model, optimizer = objects.models[0], objects.optimizers[0]
    batch = torch.linspace(-1, 1, 8).reshape(2, 4) * (objects.step + 1)  # the same on every process (replicas)
    model(batch).pow(2).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    objects.schedulers[0].step()
    objects.custom_objects[0].count += 1
    objects.step += 1


def _snapshot(objects: TrainingObjects) -> dict:
    return {"weights": {k: v.clone() for k, v in objects.models[0].state_dict().items()},
            "exp_avg": [s["exp_avg"].clone() for s in objects.optimizers[0].state_dict()["state"].values()],
            "lr": objects.schedulers[0].get_last_lr(), "count": objects.custom_objects[0].count}


def _same(a: dict, b: dict) -> bool:
    return (a["lr"] == b["lr"] and a["count"] == b["count"]
            and all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
            and all(torch.equal(x, y) for x, y in zip(a["exp_avg"], b["exp_avg"], strict=True)))


def _save_train_load(root: str, world: int) -> dict:
    """Save after one step, train on, load: the saved state must come back exactly."""
    strategy = Strategy(torch.device("cpu"), Precision(), DistributedType.MULTI_CPU if world > 1 else DistributedType.NO,
                        num_processes=world)
    manager = CheckpointManager(strategy)  # ranks from torch's default group
    objects = _objects()
    torch.manual_seed(100 + manager.ranks.process_index)  # each process its own generator stream
    _train(objects)
    sealed: list[str] = []
    seal = SealedSink.seal
    SealedSink.seal = lambda self, path: (sealed.append(path.name), seal(self, path))[1]  # type: ignore[method-assign]
    try:
        folder = manager.save(objects, Path(root) / "ckpt")
    finally:
        SealedSink.seal = seal  # type: ignore[method-assign]
    saved, saved_step, next_draw = _snapshot(objects), objects.step, torch.rand(3)
    _train(objects)
    _train(objects)
    changed = not _same(saved, _snapshot(objects))
    loaded_folder, step = manager.load(objects, folder)
    return {"rank": manager.ranks.process_index, "changed": changed, "restored": _same(saved, _snapshot(objects)),
            "step": (step, saved_step), "draw": torch.equal(torch.rand(3), next_draw), "sealed": sorted(sealed),
            "manifest": json.loads((folder / "hasten_checkpoint.json").read_text()), "folder": loaded_folder == folder}


def _check(result: dict, world: int) -> None:
    assert result["changed"] and result["restored"] and result["draw"] and result["folder"]
    assert result["step"] == (1, 1)
    manifest = result["manifest"]
    assert manifest["num_processes"] == world
    assert {f"random_states_{r}.pkl" for r in range(world)} | {"model.safetensors", "optimizer.bin",
                                                                 "scheduler.bin", "custom_checkpoint_0.pkl"} \
        == set(manifest["files"])
    own_rng = f"random_states_{result['rank']}.pkl"
    shared = ["custom_checkpoint_0.pkl", "model.safetensors", "optimizer.bin", own_rng, "scheduler.bin"]
    assert result["sealed"] == (sorted(shared) if result["rank"] == 0 else [own_rng])


def test_manager_saves_and_loads_without_an_accelerator(tmp_path):
    _check(_save_train_load(str(tmp_path), 1), 1)
    manager = CheckpointManager(Strategy(torch.device("cpu"), Precision(), DistributedType.NO), Ranks())
    objects = _objects()
    objects.custom_objects = []  # the folder holds one registered object: refused before anything changed
    before = _snapshot(dataclasses.replace(objects, custom_objects=[Counter()]))
    with pytest.raises(CheckpointError, match="holds 1 registered objects but 0"):
        manager.load(objects, tmp_path / "ckpt")
    assert _same(before, _snapshot(dataclasses.replace(objects, custom_objects=[Counter()])))


def test_manager_on_two_forked_gloo_ranks(tmp_path):
    results = run_on_ranks(_save_train_load, world_size=2, args=(str(tmp_path), 2))
    assert [r["rank"] for r in results] == [0, 1]
    for result in results:
        _check(result, 2)
