"""Checkpoints never destroy, never execute, never half-load (issue 18), with fault injection (another
number of processes: test_checkpoint_process_count.py).

Ground truth everywhere: the bytes and objects as they were before the failed operation, the
weights of the checkpoint that must survive, and a marker file that a crafted pickle would create.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from hasten import Accelerator, ProjectConfiguration
from hasten.checkpointing import CheckpointError
from hasten.testing import run_on_ranks
from helpers.checkpoints import Counter, prepared_model_optimizer_scheduler, same_tensors, weights_of


def _step(accelerator, model, optimizer, scheduler):
    accelerator.backward(model(torch.ones(3, 4)).pow(2).mean())
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


class Marker:
    """Unpickling this runs code that creates ``path``: the proof that a load executed a file."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').write('ran')",))


# ------------------------------------------------------------------------------ 1. never destroy
def test_save_state_refuses_a_file_or_a_folder_of_user_files(tmp_path):
    accelerator, *_ = prepared_model_optimizer_scheduler()
    folder = tmp_path / "ck"
    (folder / "logs").mkdir(parents=True)
    (folder / "notes.txt").write_text("mine")
    (folder / "logs" / "run.log").write_text("log")
    with pytest.raises(CheckpointError, match=r"ck already holds files .*(logs|notes\.txt)"):
        accelerator.save_state(folder)
    assert (folder / "notes.txt").read_text() == "mine" and (folder / "logs" / "run.log").read_text() == "log"
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no staging folder, no .old left behind
    target = tmp_path / "weights"
    target.write_text("a file")
    with pytest.raises(CheckpointError, match=r"weights is a file"):
        accelerator.save_state(target)
    assert target.read_text() == "a file" and sorted(os.listdir(tmp_path)) == ["ck", "weights"]


def test_replacing_a_checkpoint_keeps_user_files_out_of_harms_way(tmp_path):
    accelerator, model, optimizer, scheduler = prepared_model_optimizer_scheduler()
    first = accelerator.save_state(tmp_path / "ck")
    _step(accelerator, model, optimizer, scheduler)
    accelerator.save_state(tmp_path / "ck")  # an earlier hasten checkpoint is replaced
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert same_tensors(load_file(str(first / "model.safetensors")), weights_of(accelerator, model))
    (first / "notes.txt").write_text("added by the user")
    with pytest.raises(CheckpointError, match="notes.txt"):
        accelerator.save_state(tmp_path / "ck")
    assert (first / "notes.txt").read_text() == "added by the user"


def test_save_state_dot_and_relative_paths(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    accelerator, model, optimizer, scheduler = prepared_model_optimizer_scheduler()
    assert accelerator.save_state(".") == work
    saved = weights_of(accelerator, model)
    _step(accelerator, model, optimizer, scheduler)
    accelerator.save_state(".")  # replaces the checkpoint in the working directory, in place
    _step(accelerator, model, optimizer, scheduler)
    assert accelerator.save_state("runs/../../ck") == tmp_path / "ck"
    accelerator.load_state(".")
    assert not same_tensors(weights_of(accelerator, model), saved)  # the second save, not the first
    assert not any(name.startswith(".hasten_staging") for name in os.listdir(work))
    (work / "train.py").write_text("# the user's script")
    with pytest.raises(CheckpointError, match="train.py"):
        accelerator.save_state(".")
    assert (work / "train.py").exists()


SAVE_AND_DIE = textwrap.dedent("""
    import sys, torch
    from torch import nn
    from hasten import Accelerator, ProjectConfiguration
    from hasten.checkpointing import SAVE_STAGE_HOOKS, publication
    root, mode, stage = sys.argv[1], sys.argv[2], sys.argv[3]
    if mode == "fallback":                          # a system without an atomic exchange
        publication._exchange = lambda first, second: False
    auto = mode == "auto"
    config = ProjectConfiguration(project_dir=root, automatic_checkpoint_naming=auto, total_limit=1 if auto else None)
    accelerator = Accelerator(project_config=config)
    torch.manual_seed(0)
    model = accelerator.prepare(nn.Linear(3, 3))
    accelerator.save_state(root + "/ck")            # A: complete
    with torch.no_grad():
        model.weight.add_(1.0)
    def die(name, folder):
        if name == stage:
            print("AT", name, flush=True)
            sys.stdin.readline()                    # wait here until killed
    SAVE_STAGE_HOOKS.append(die)
    accelerator.save_state(root + "/ck")            # B: killed at `stage`
    print("AT end", flush=True)
    sys.stdin.readline()
""")


@pytest.mark.parametrize("mode,stage", [("named", "staged"), ("named", "before_publish"), ("named", "exchanged"),
                                        ("fallback", "between_renames"), ("auto", "before_publish"),
                                        ("auto", "published")])
def test_kill_9_at_any_point_of_a_save_leaves_a_complete_checkpoint(tmp_path, mode, stage):
    script = tmp_path / "save.py"
    script.write_text(SAVE_AND_DIE)
    root = tmp_path / "proj"
    (root / "logs").mkdir(parents=True)  # the user's files beside the checkpoint
    (root / "notes.txt").write_text("mine")
    (root / "logs" / "run.log").write_text("log")
    proc = subprocess.Popen([sys.executable, str(script), str(root), mode, stage], stdout=subprocess.PIPE,
                            stdin=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == f"AT {stage}"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    from hasten.state import reset_state

    reset_state()
    auto = mode == "auto"
    accelerator = Accelerator(project_config=ProjectConfiguration(project_dir=str(root),
                                                                  automatic_checkpoint_naming=auto, total_limit=1))
    torch.manual_seed(1)
    model = accelerator.prepare(nn.Linear(3, 3))
    loaded = accelerator.load_state(None if auto else root / "ck")  # checksums verified on the way
    torch.manual_seed(0)
    original = nn.Linear(3, 3).weight.detach()
    delta = (model.weight - original).detach()
    assert torch.allclose(delta, torch.zeros(3, 3)) or torch.allclose(delta, torch.ones(3, 3))
    if stage in ("staged", "before_publish", "between_renames"):
        assert torch.equal(delta, torch.zeros(3, 3)), "the previous checkpoint must still be the one in place"
    else:
        assert torch.allclose(delta, torch.ones(3, 3)), "the published checkpoint must be the new one"
    if auto:
        assert loaded.name in ("checkpoint_0", "checkpoint_1")
    accelerator.save_state(None if auto else root / "ck")  # leftovers of the killed save are cleaned up
    names = sorted(os.listdir(root / "checkpoints" if auto else root))
    assert not [n for n in names if n.endswith((".tmp", ".old"))], names
    assert (root / "notes.txt").read_text() == "mine" and (root / "logs" / "run.log").read_text() == "log"


# ---------------------------------------------------------------------------- 3. never execute
def test_crafted_registered_object_and_rng_files_are_refused(tmp_path):
    accelerator, model, *_ = prepared_model_optimizer_scheduler()
    accelerator.register_for_checkpointing(Counter(3))
    folder = accelerator.save_state(tmp_path / "ck")
    marker = tmp_path / "ran"
    before = weights_of(accelerator, model)
    for name in ("custom_checkpoint_0.pkl", "random_states_0.pkl"):
        genuine = (folder / name).read_bytes()
        torch.save({"count": Marker(marker)}, folder / name)
        with pytest.raises(CheckpointError, match=name):
            accelerator.load_state(folder, verify_checksums=False)  # the unpickler itself must refuse it
        assert not marker.exists()
        assert same_tensors(weights_of(accelerator, model), before)
        (folder / name).write_bytes(genuine)


class Colour(enum.Enum):
    RED = 1
    BLUE = 2


@dataclasses.dataclass
class Where:
    path: pathlib.Path
    when: datetime.datetime
    colour: Colour


class RichState:
    """A registered object holding what Accelerate users store: NumPy, datetime, Path, enums, dataclasses."""

    def __init__(self):
        self.value = {}

    def state_dict(self):
        return self.value

    def load_state_dict(self, state):
        self.value = state


def test_registered_objects_with_numpy_datetime_path_enum_dataclass_round_trip(tmp_path, monkeypatch):
    from hasten.checkpointing import add_safe_types, safe_load

    monkeypatch.setattr(safe_load, "_REGISTERED_TYPES", {})
    add_safe_types(Colour, Where)  # the program's own classes: trusted explicitly (issue 28)
    accelerator, *_ = prepared_model_optimizer_scheduler()
    rich = RichState()
    accelerator.register_for_checkpointing(rich)
    now = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)
    rich.value = {"best": np.float32(0.25), "steps": np.int64(7), "history": np.arange(5, dtype=np.float64),
                  "started": now, "took": datetime.timedelta(seconds=3), "day": now.date(),
                  "out": pathlib.Path("runs/x"), "colour": Colour.BLUE, "where": Where(pathlib.Path("/d"), now, Colour.RED)}
    expected = dict(rich.value)
    folder = accelerator.save_state(tmp_path / "ck")
    rich.value = {}
    accelerator.load_state(folder)
    got = rich.value
    assert got.keys() == expected.keys()
    assert np.array_equal(got["history"], expected["history"]) and got["history"].dtype == np.float64
    assert all(got[k] == expected[k] for k in expected if k != "history")
    assert type(got["best"]) is np.float32 and got["where"] == expected["where"]


def _dcp_folder(root: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    folder = root / "pytorch_model_fsdp_0"
    dcp.save({"model": {"weight": torch.arange(6.0).reshape(2, 3)}}, checkpoint_id=str(folder), no_dist=True)
    return folder


def _craft_metadata(folder: Path, marker: Path) -> None:
    import pickle

    (folder / ".metadata").write_bytes(pickle.dumps(Marker(marker)))


def test_merge_weights_refuses_crafted_dcp_metadata(tmp_path, capsys):
    from hasten.commands.main import main

    folder = _dcp_folder(tmp_path / "ck")
    assert main(["merge-weights", str(tmp_path / "ck"), str(tmp_path / "ok")]) == 0  # the genuine folder merges
    assert torch.equal(load_file(str(tmp_path / "ok" / "model.safetensors"))["weight"], torch.arange(6.0).reshape(2, 3))
    marker = tmp_path / "ran"
    _craft_metadata(folder, marker)
    assert main(["merge-weights", str(tmp_path / "ck"), str(tmp_path / "merged")]) == 1
    assert ".metadata" in capsys.readouterr().err
    assert not marker.exists()


def test_dcp_non_tensor_items_are_read_without_running_code(tmp_path):
    import torch.distributed.checkpoint as dcp

    from hasten.checkpointing.safe_load import dcp_planner, dcp_reader

    marker = tmp_path / "ran"
    folder = tmp_path / "items"
    dcp.save({"x": torch.ones(2), "extra": {"lr": 0.5, "evil": Marker(marker)}}, checkpoint_id=str(folder), no_dist=True)
    state = {"x": torch.zeros(2), "extra": {"lr": 0.0, "evil": None}}
    with pytest.raises(BaseException) as info:  # DCP wraps the reader's error in a BaseException
        dcp.load(state, storage_reader=dcp_reader(folder), planner=dcp_planner(folder), no_dist=True)
    assert "extra.evil" in str(getattr(info.value, "failures", info.value))
    assert not marker.exists()
    clean = tmp_path / "clean"
    dcp.save({"x": torch.ones(2), "extra": {"lr": 0.5, "betas": (0.9, 0.99)}}, checkpoint_id=str(clean), no_dist=True)
    state = {"x": torch.zeros(2), "extra": {"lr": 0.0, "betas": None}}
    dcp.load(state, storage_reader=dcp_reader(clean), planner=dcp_planner(clean), no_dist=True)
    assert state["extra"] == {"lr": 0.5, "betas": (0.9, 0.99)} and torch.equal(state["x"], torch.ones(2))


def _fsdp2_crafted(root: str) -> str:
    from hasten.utils import FullyShardedDataParallelPlugin

    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    folder = accelerator.save_state(Path(root) / "ck")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        _craft_metadata(folder / "pytorch_model_fsdp_0", Path(root) / "ran")
    accelerator.wait_for_everyone()
    try:
        accelerator.load_state(folder, verify_checksums=False)
    except CheckpointError as exc:
        return str(exc)
    return "loaded"


def test_fsdp2_sharded_checkpoint_with_crafted_metadata_is_refused_on_every_rank(tmp_path):
    errors = run_on_ranks(_fsdp2_crafted, world_size=2, args=(str(tmp_path),))
    assert errors[0] == errors[1] and ".metadata" in errors[0]
    assert not (tmp_path / "ran").exists()


def _deepspeed_crafted(root: str) -> str:
    from hasten.config.plugins.deepspeed import DeepSpeedPlugin

    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, torch.optim.Adam(model.parameters(), lr=0.1), loader)
    folder = accelerator.save_state(Path(root) / "ck")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        target = folder / "pytorch_model" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        torch.save({"optimizer_state_dict": Marker(Path(root) / "ran")}, target)
    accelerator.wait_for_everyone()
    try:
        accelerator.load_state(folder, verify_checksums=False)
    except CheckpointError as exc:
        return str(exc)
    return "loaded"


@pytest.mark.slow
def test_deepspeed_checkpoint_with_a_crafted_file_is_refused_on_every_rank(tmp_path):
    from hasten.testing import preload_deepspeed

    preload_deepspeed()
    errors = run_on_ranks(_deepspeed_crafted, world_size=2, args=(str(tmp_path),), timeout=240)
    assert errors[0] == errors[1] and "zero_pp_rank_1_mp_rank_00_optim_states.pt" in errors[0], errors
    assert not (tmp_path / "ran").exists()


# -------------------------------------------------------------------------- 4. never half-load
class Fussy(Counter):
    """A registered object that refuses the saved state (after partly taking it, as real code does)."""

    def load_state_dict(self, state):
        self.count = -1
        if state["count"] == 6:
            raise KeyError("epoch")
        self.count = state["count"]


def test_a_failing_registered_object_changes_nothing(tmp_path):
    accelerator, model, optimizer, scheduler = prepared_model_optimizer_scheduler()
    first, fussy = Counter(5), Fussy(6)
    accelerator.register_for_checkpointing(first, fussy)
    folder = accelerator.save_state(tmp_path / "ck")
    _step(accelerator, model, optimizer, scheduler)
    first.count, fussy.count = 50, 60
    weights, opt_state = weights_of(accelerator, model), optimizer.state_dict()
    sched_state, rng = scheduler.state_dict(), torch.get_rng_state()
    with pytest.raises(CheckpointError, match=r"registered object #1 \(Fussy\).*KeyError"):
        accelerator.load_state(folder)
    assert first.count == 50 and fussy.count == 60  # both put back
    assert same_tensors(weights_of(accelerator, model), weights) and scheduler.state_dict() == sched_state
    assert torch.equal(torch.get_rng_state(), rng)
    after = optimizer.state_dict()
    assert all(torch.equal(after["state"][k]["exp_avg"], opt_state["state"][k]["exp_avg"]) for k in opt_state["state"])


def test_an_optimizer_that_does_not_match_is_refused_before_anything_changes(tmp_path):
    accelerator, model, optimizer, scheduler = prepared_model_optimizer_scheduler()
    folder = accelerator.save_state(tmp_path / "ck")
    from hasten.state import reset_state

    reset_state()
    accelerator = Accelerator()
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    groups = [{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.1}]
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(groups, lr=0.01))
    before = weights_of(accelerator, model)
    with pytest.raises(CheckpointError, match=r"optimizer.bin holds 1 parameter groups but the optimizer has 2"):
        accelerator.load_state(folder)
    assert same_tensors(weights_of(accelerator, model), before)


# ---------------------------------------------------------------------------- 5. checksums
def test_a_flipped_byte_inside_tensor_data_is_caught_and_named(tmp_path):
    import json

    accelerator, model, *_ = prepared_model_optimizer_scheduler()
    folder = accelerator.save_state(tmp_path / "ck")
    manifest = json.loads((folder / "hasten_checkpoint.json").read_text())
    assert manifest["num_processes"] == 1
    assert set(manifest["files"]) == set(os.listdir(folder)) - {"hasten_checkpoint.json"}
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40  # inside the last tensor's bytes: the header stays valid
    path.write_bytes(bytes(data))
    before = weights_of(accelerator, model)
    with pytest.raises(CheckpointError, match=r"model.safetensors is damaged: its checksum differs"):
        accelerator.load_state(folder)
    assert same_tensors(weights_of(accelerator, model), before)
    accelerator.load_state(folder, verify_checksums=False)  # without the check the damage loads silently
    assert not same_tensors(weights_of(accelerator, model), before)


# --------------------------------------------------------------------------- 6. durable writes
def test_files_and_folders_are_fsynced_before_the_rename_that_publishes(tmp_path, monkeypatch):
    from hasten.checkpointing import publication

    events = []
    real_fsync, real_replace, real_exchange = os.fsync, os.replace, publication._exchange

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, **kwargs):
        events.append(("rename", str(src), str(dst)))
        return real_replace(src, dst, **kwargs)

    def exchange(first, second):
        events.append(("rename", str(first), str(second)))
        return real_exchange(first, second)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(publication, "_exchange", exchange)
    accelerator, *_ = prepared_model_optimizer_scheduler()
    for _ in range(2):  # a new folder, then a replacement (exchange)
        events.clear()
        target = accelerator.save_state(tmp_path / "ck")
        staging = str(tmp_path / "ck.tmp")
        publish = max(i for i, e in enumerate(events) if e[0] == "rename" and e[1] == staging)
        synced_before = {e[1] for e in events[:publish] if e[0] == "fsync"}
        for name in set(os.listdir(target)) - {"hasten_checkpoint.json"}:  # the manifest: atomic write, below
            assert f"{staging}/{name}" in synced_before, name
        assert staging in synced_before  # the staging folder's entries
        assert ("fsync", str(tmp_path)) in events[publish:]  # the rename itself
    for e in events:  # every single-file write went to a temporary name, synced before its rename
        if e[0] == "rename" and e[1].endswith(".tmp") and "/." in e[1]:
            assert ("fsync", e[1]) in events[: events.index(e)]


def test_dcp_metadata_pointing_outside_its_folder_is_refused(tmp_path):
    import dataclasses as dc
    import pickle

    from hasten.checkpointing.dcp import merge_sharded_weights
    from hasten.checkpointing.safe_load import load_pickle

    folder = _dcp_folder(tmp_path / "ck")
    metadata = load_pickle(folder / ".metadata")
    metadata.storage_data = {k: dc.replace(v, relative_path="../../secret") for k, v in metadata.storage_data.items()}
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=r"\.metadata points outside its folder"):
        merge_sharded_weights(tmp_path / "ck", tmp_path / "merged")
