"""save_state / load_state / save_model: layout, automatic naming, validation, crash safety."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from hasten import Accelerator, ProjectConfiguration
from hasten.checkpointing import CheckpointError


class TiedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.hidden = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, idx):
        return self.head(torch.relu(self.hidden(self.embed(idx))))


class Counter:
    def __init__(self):
        self.count = 0

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def _setup(**kwargs):
    accelerator = Accelerator(**kwargs)
    torch.manual_seed(0)
    model = TiedNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    return accelerator, model, optimizer, scheduler


def _train_step(accelerator, model, optimizer, scheduler):
    loss = model(torch.arange(6) % 10).logsumexp(-1).mean()
    accelerator.backward(loss)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def test_round_trip_restores_everything(tmp_path):
    accelerator, model, optimizer, scheduler = _setup()
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    _train_step(accelerator, model, optimizer, scheduler)
    counter.count = 7
    folder = accelerator.save_state(tmp_path / "ckpt")
    names = sorted(os.listdir(folder))
    assert names == ["custom_checkpoint_0.pkl", "hasten_checkpoint.json", "model.safetensors", "optimizer.bin",
                     "random_states_0.pkl",
                     "scheduler.bin"]
    saved = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    expected_next = torch.rand(3)  # what the RNG gives right after the save
    _train_step(accelerator, model, optimizer, scheduler)
    counter.count = 0
    accelerator.load_state(folder)
    assert torch.equal(torch.rand(3), expected_next)
    for k, v in accelerator.unwrap_model(model).state_dict().items():
        assert torch.equal(v, saved[k]), k
    inner = accelerator.unwrap_model(model)
    assert inner.head.weight is inner.embed.weight  # still tied after loading
    assert counter.count == 7 and scheduler.scheduler.last_epoch == 1
    assert optimizer.state_dict()["state"][0]["step"].item() == 1


@pytest.mark.world_size(2)
def test_ddp_save_has_no_module_prefix_and_per_rank_rng(tmp_path):
    accelerator, model, optimizer, scheduler = _setup()
    assert isinstance(model, nn.parallel.DistributedDataParallel)
    folder = accelerator.save_state(tmp_path / "ddp")
    keys = load_file(str(folder / "model.safetensors")).keys()
    assert keys and not any(k.startswith("module.") for k in keys)
    assert (folder / "random_states_0.pkl").exists() and (folder / "random_states_1.pkl").exists()
    accelerator.load_state(folder)


def test_automatic_naming_prunes_and_restores_iteration(tmp_path):
    config = dict(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    accelerator, *_ = _setup(project_config=ProjectConfiguration(**config))
    accelerator.save_state()
    accelerator.save_state("ignored/with/automatic/naming")
    from hasten.state import reset_state
    reset_state()
    accelerator, *_ = _setup(project_config=ProjectConfiguration(**config))  # a restarted run
    loaded = accelerator.load_state()
    assert loaded.name == "checkpoint_1" and accelerator.save_iteration == 2
    accelerator.save_state()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_1", "checkpoint_2"]


def test_load_errors_name_the_problem_and_change_nothing(tmp_path):
    accelerator, model, optimizer, scheduler = _setup()
    with pytest.raises(CheckpointError, match="does not exist"):
        accelerator.load_state(tmp_path / "nowhere")
    other = tmp_path / "other"
    other.mkdir()
    from safetensors.torch import save_file
    save_file({"hidden.weight": torch.zeros(4, 4), "extra": torch.zeros(1)}, str(other / "model.safetensors"))
    before = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    with pytest.raises(CheckpointError, match=r"missing keys .*embed.weight.*unexpected keys \['extra'\]"):
        accelerator.load_state(other)
    for k, v in accelerator.unwrap_model(model).state_dict().items():
        assert torch.equal(v, before[k])  # nothing half-loaded
    folder = accelerator.save_state(tmp_path / "good")
    accelerator.register_for_checkpointing(Counter())
    with pytest.raises(CheckpointError, match="holds 0 registered objects but 1"):
        accelerator.load_state(folder)


def test_truncated_file_is_named(tmp_path):
    accelerator, *_ = _setup()
    folder = accelerator.save_state(tmp_path / "c")
    data = (folder / "optimizer.bin").read_bytes()
    (folder / "optimizer.bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="optimizer.bin"):
        accelerator.load_state(folder)
    (folder / "model.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        accelerator.load_state(folder)


def test_save_model_shards_and_index(tmp_path):
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])  # 16,640 bytes per layer
    accelerator.save_model(model, tmp_path / "big", max_shard_size="1MB")
    assert sorted(os.listdir(tmp_path / "big")) == ["model.safetensors"]
    accelerator.save_model(model, tmp_path / "big", max_shard_size="100KB")
    files = sorted(os.listdir(tmp_path / "big"))
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) == 2 and "model.safetensors" not in files  # 6 layers fit in 100 KB; stale file gone
    index = json.loads((tmp_path / "big" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(p.numel() * 4 for p in model.parameters())
    state = {}
    for shard in shards:
        state.update(load_file(str(tmp_path / "big" / shard)))
    clone = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
    clone.load_state_dict(state)
    x = torch.randn(2, 64)
    assert torch.equal(clone(x), model(x))


SAVE_AND_PAUSE = textwrap.dedent("""
    import sys, torch
    from torch import nn
    from hasten import Accelerator, ProjectConfiguration
    from hasten.checkpointing import SAVE_STAGE_HOOKS
    accelerator = Accelerator(project_config=ProjectConfiguration(project_dir=sys.argv[1], automatic_checkpoint_naming=True))
    model = accelerator.prepare(nn.Linear(3, 3))
    accelerator.save_state()                        # checkpoint_0: complete
    with torch.no_grad():
        model.weight.add_(1.0)
    def pause(stage, folder):
        print("PAUSED", flush=True)
        sys.stdin.readline()                        # wait here until killed
    SAVE_STAGE_HOOKS.append(pause)
    accelerator.save_state()                        # checkpoint_1: killed before it is published
""")


def test_kill_during_save_keeps_previous_checkpoint(tmp_path):
    script = tmp_path / "save.py"
    script.write_text(SAVE_AND_PAUSE)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "proj")], stdout=subprocess.PIPE,
                            stdin=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "PAUSED"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    entries = sorted(os.listdir(tmp_path / "proj" / "checkpoints"))
    assert entries == ["checkpoint_0", "checkpoint_1.tmp"]
    accelerator = Accelerator(project_config=ProjectConfiguration(project_dir=str(tmp_path / "proj"),
                                                                  automatic_checkpoint_naming=True))
    model = accelerator.prepare(nn.Linear(3, 3))
    assert accelerator.load_state().name == "checkpoint_0"
    assert accelerator.save_iteration == 1
    saved = load_file(str(tmp_path / "proj" / "checkpoints" / "checkpoint_0" / "model.safetensors"))
    assert torch.equal(model.weight, saved["weight"])
    accelerator.save_state()  # the leftover staging folder is replaced, not mistaken for a checkpoint
    assert sorted(os.listdir(tmp_path / "proj" / "checkpoints")) == ["checkpoint_0", "checkpoint_1"]
    assert Path(tmp_path / "proj" / "checkpoints" / "checkpoint_1" / "model.safetensors").exists()
