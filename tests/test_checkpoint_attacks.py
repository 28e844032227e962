"""Checkpoints attacked a second time (issue 28): crafted classes never run, manifests never reach outside
their folder, user files that merely look like checkpoint files survive, interrupted saves and rotations
never block or confuse the next run, and a load failing on one process fails on all.

Ground truth: a marker file a constructor would create, the bytes of files outside the folder, and the
weights of the checkpoint that must survive.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from hasten import Accelerator, ProjectConfiguration
from hasten.checkpointing import CheckpointError, safe_load
from hasten.testing import run_on_ranks


def _setup(**kwargs):
    accelerator = Accelerator(**kwargs)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    return (accelerator, *accelerator.prepare(model, optimizer))


def _weights(accelerator, model):
    return {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class Counter:
    def __init__(self, count=0):
        self.count = count

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


# ------------------------------------------------------------------------ 1. no constructor runs
@dataclasses.dataclass
class Touchy:
    """A dataclass of the user's program whose ``__post_init__`` has a side effect."""

    path: str

    def __post_init__(self):
        Path(self.path).write_text("ran")


class Moody(enum.Enum):
    """An enum whose ``_missing_`` hook has a side effect."""

    CALM = 1

    @classmethod
    def _missing_(cls, value):
        Path(value).write_text("ran")
        return cls.CALM


@dataclasses.dataclass
class Restoring:
    """A dataclass whose ``__setstate__`` has a side effect."""

    path: str

    def __setstate__(self, state):
        Path(state["path"]).write_text("ran")
        self.__dict__.update(state)


class Call:
    """Pickles as the call ``target(*args)``: what a crafted file asks the unpickler to do."""

    def __init__(self, target, *args):
        self.target, self.args = target, args

    def __reduce__(self):
        return (self.target, self.args)


def _transformers_training_arguments(marker: Path):
    from transformers import TrainingArguments

    return Call(TrainingArguments, str(marker))


CRAFTED = {
    "post_init": lambda marker: Call(Touchy, str(marker)),
    "enum_missing": lambda marker: Call(Moody, str(marker)),
    "setstate": lambda marker: Restoring(str(marker)),
    "transformers": _transformers_training_arguments,
}


@pytest.mark.parametrize("file", ["custom_checkpoint_0.pkl", "random_states_0.pkl"])
@pytest.mark.parametrize("gadget", sorted(CRAFTED))
def test_a_class_of_the_program_is_never_constructed_by_a_load(tmp_path, monkeypatch, file, gadget):
    monkeypatch.setattr(safe_load, "_REGISTERED_TYPES", {}, raising=False)
    accelerator, model, _ = _setup()
    accelerator.register_for_checkpointing(Counter(3))
    folder = accelerator.save_state(tmp_path / "ck")
    marker = tmp_path / "ran"
    torch.save({"count": CRAFTED[gadget](marker), "step": 0}, folder / file)
    before = _weights(accelerator, model)
    with pytest.raises(CheckpointError, match=rf"{file} holds a type outside the allow-list") as info:
        accelerator.load_state(folder, verify_checksums=False)
    assert not marker.exists()
    assert _same(_weights(accelerator, model), before)
    if file.startswith("custom"):
        assert "add_safe_types" in str(info.value)


def test_user_types_in_registered_objects_need_explicit_registration(tmp_path, monkeypatch):
    monkeypatch.setattr(safe_load, "_REGISTERED_TYPES", {}, raising=False)
    accelerator, *_ = _setup()
    holder = Counter({"phase": Moody.CALM})
    accelerator.register_for_checkpointing(holder)
    folder = accelerator.save_state(tmp_path / "ck")
    holder.count = None
    with pytest.raises(CheckpointError, match=r"Moody.*add_safe_types"):
        accelerator.load_state(folder)
    assert holder.count is None
    from hasten.checkpointing import add_safe_types
    from hasten.checkpointing.custom import load_custom_state

    add_safe_types(Moody)
    accelerator.load_state(folder)
    assert holder.count == {"phase": Moody.CALM}
    holder.count = None
    load_custom_state(holder, folder, 0)  # Accelerate's function reads the same allow-list
    assert holder.count == {"phase": Moody.CALM}
    # The RNG files' allow-list is exact: a registered class is still refused there.
    torch.save({"step": Moody.CALM}, folder / "random_states_0.pkl")
    with pytest.raises(CheckpointError, match=r"random_states_0.pkl holds a type outside"):
        accelerator.load_state(folder, verify_checksums=False)
    with pytest.raises(TypeError, match="not a class"):
        add_safe_types(Moody.CALM)
