"""How a checkpoint file is written is chosen by the sink its caller hands over, never by its path (issue 34, item 1).

Ground truths: the files on disk when a write returns (a write outside any save is complete then), and a
save's files written with no other save around (the same bytes when another save runs beside it).
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
from torch import nn

from hasten.base.dataclasses import DistributedType
from hasten.checkpointing import SAVE_STAGE_HOOKS, files, write_model_files
from hasten.checkpointing.manager import CheckpointManager, Ranks, TrainingObjects
from hasten.checkpointing.publication import staging_folder
from hasten.precision import Precision
from hasten.strategies.base import Strategy


class Note:
    """A registered object whose ``state_dict`` (run while an asynchronous save takes its snapshot) writes
    a file of its own with the atomic helper, into the folder being saved."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.on_disk_when_written: bool | None = None

    def state_dict(self) -> dict:
        files.torch_save({"note": torch.arange(3)}, self.path)  # no sink given: atomic, now
        self.on_disk_when_written = self.path.is_file()
        return {"count": 1}

    def load_state_dict(self, state: dict) -> None:
        pass


def _manager() -> CheckpointManager:
    return CheckpointManager(Strategy(torch.device("cpu"), Precision(), DistributedType.NO), Ranks())


def _objects(custom: list | None = None) -> TrainingObjects:
    torch.manual_seed(0)
    model = nn.Linear(6, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 6)).sum().backward()
    optimizer.step()
    return TrainingObjects(models=[model], optimizers=[optimizer], custom_objects=custom or [])


def _contents(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_write_not_handed_the_snapshot_sink_is_never_diverted_into_an_asynchronous_save(tmp_path):
    # Before the sinks, write_file looked the path up in a process-wide registry of the folders asynchronous
    # saves were capturing: a helper's atomic write under such a folder was silently staged and written later.
    target = tmp_path / "ckpt"
    note = Note(staging_folder(target) / "note.pt")
    manager = _manager()
    manager.save(_objects([note]), target, async_save=True)
    manager.wait()
    assert note.on_disk_when_written is True
    assert torch.equal(files.torch_load(target / "note.pt")["note"], torch.arange(3))


def test_save_model_while_an_asynchronous_save_is_in_flight_writes_what_it_writes_alone(tmp_path):
    # Two saves at once, each with its own sink: an asynchronous save held in its background thread while
    # save_model's files are written to another folder. Each folder holds the bytes it holds when saved alone.
    objects = _objects()
    weights = objects.models[0].state_dict()
    alone_ckpt, alone_model = tmp_path / "alone" / "ckpt", tmp_path / "alone" / "model"
    _manager().save(objects, alone_ckpt)
    write_model_files(weights, alone_model)

    held, release = threading.Event(), threading.Event()

    def hold(stage: str, folder: Path) -> None:
        if stage == "before_publish":
            held.set()
            release.wait(timeout=60)

    manager = _manager()
    SAVE_STAGE_HOOKS.append(hold)
    try:
        manager.save(objects, tmp_path / "ckpt", async_save=True)
        assert held.wait(timeout=60), "the background save never reached publication"
        write_model_files(weights, tmp_path / "model")
        release.set()
        manager.wait()
    finally:
        release.set()
        SAVE_STAGE_HOOKS.clear()
    assert _contents(tmp_path / "model") == _contents(alone_model)
    saved, alone = _contents(tmp_path / "ckpt"), _contents(alone_ckpt)
    manifest = "hasten_checkpoint.json"  # names its folder's time of writing; every other file is equal
    assert saved.keys() == alone.keys() and manifest in saved
    assert {k: v for k, v in saved.items() if k != manifest} == {k: v for k, v in alone.items() if k != manifest}
