"""A damaged safetensors shard names the file and loads nothing (issue 16)."""

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from hasten.big_modeling import load_checkpoint_in_model
from hasten.big_modeling.loading import load_state_dict
from hasten.checkpointing import CheckpointError


def _sharded(folder, model):
    folder.mkdir()
    state = model.state_dict()
    names = list(state)
    weight_map = {}
    for i, part in enumerate((names[:2], names[2:])):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: state[k].contiguous() for k in part}, folder / file)
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder / "model-00002-of-00002.safetensors"


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _bad_header(path):
    data = bytearray(path.read_bytes())
    data[8:16] = b"#garbage"  # the JSON header no longer parses
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_truncate, _bad_header], ids=["truncated", "bad-header"])
def test_damaged_safetensors_shard_names_the_file_and_loads_nothing(tmp_path, damage):
    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    shard = _sharded(tmp_path / "ckpt", source)
    damage(shard)
    target = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors' is damaged") as info:
        load_checkpoint_in_model(target, tmp_path / "ckpt")
    assert "HINT" in str(info.value)
    # The intact first shard was not applied either: a failed load changes nothing.
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        load_state_dict(shard)
