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
from helpers.checkpoints import Counter, prepared_model_optimizer, same_tensors, weights_of


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
    accelerator, model, _ = prepared_model_optimizer()
    accelerator.register_for_checkpointing(Counter(3))
    folder = accelerator.save_state(tmp_path / "ck")
    marker = tmp_path / "ran"
    torch.save({"count": CRAFTED[gadget](marker), "step": 0}, folder / file)
    before = weights_of(accelerator, model)
    with pytest.raises(CheckpointError, match=rf"{file} holds a type outside the allow-list") as info:
        accelerator.load_state(folder, verify_checksums=False)
    assert not marker.exists()
    assert same_tensors(weights_of(accelerator, model), before)
    if file.startswith("custom"):
        assert "add_safe_types" in str(info.value)


def test_user_types_in_registered_objects_need_explicit_registration(tmp_path, monkeypatch):
    monkeypatch.setattr(safe_load, "_REGISTERED_TYPES", {}, raising=False)
    accelerator, *_ = prepared_model_optimizer()
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


# ------------------------------------------------- 2. a manifest never reaches outside its folder
def _rewrite_manifest(folder: Path, edit) -> None:
    path = folder / "hasten_checkpoint.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("how", ["dotdot", "absolute", "through_a_link"])
def test_an_in_place_save_never_removes_files_a_manifest_lists_outside_the_folder(tmp_path, monkeypatch, how):
    work, outside = tmp_path / "work", tmp_path / "outside"
    work.mkdir()
    outside.mkdir()
    victim = outside / "victim.txt"
    victim.write_text("precious")
    monkeypatch.chdir(work)
    accelerator, *_ = prepared_model_optimizer()
    accelerator.save_state(".")
    listed = {"dotdot": "../outside/victim.txt", "absolute": str(victim), "through_a_link": "sub/victim.txt"}[how]
    if how == "through_a_link":
        (work / "sub").symlink_to(outside)
    _rewrite_manifest(work, lambda m: m["files"].update({listed: {"size": 8, "crc32": "00000000"}}))
    with pytest.raises(CheckpointError, match=r"crafted|sub"):
        accelerator.save_state(".")
    assert victim.read_text() == "precious"


def test_load_state_reads_nothing_a_crafted_manifest_lists_outside_the_folder(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("s" * 1234)
    accelerator, *_ = prepared_model_optimizer()
    folder = accelerator.save_state(tmp_path / "ck")
    _rewrite_manifest(folder, lambda m: m["files"].update({"../secret.txt": {"size": 1, "crc32": "00000000"}}))
    with pytest.raises(CheckpointError, match=r"damaged or crafted .*leaves the folder") as info:
        accelerator.load_state(folder)
    assert "1234" not in str(info.value)
    (folder / "hasten_checkpoint.json").unlink()
    genuine = accelerator.save_state(folder)
    (folder / "optimizer.bin").rename(tmp_path / "real_optimizer.bin")
    (folder / "optimizer.bin").symlink_to(tmp_path / "real_optimizer.bin")  # same bytes, through a link
    with pytest.raises(CheckpointError, match=r"optimizer.bin is reached through a symbolic link"):
        accelerator.load_state(genuine)
    (folder / "hasten_checkpoint.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match=r"damaged or crafted \(nested too deeply\)"):
        accelerator.load_state(folder)
    (folder / "hasten_checkpoint.json").unlink()
    (folder / "model.safetensors").rename(tmp_path / "real.safetensors")
    (folder / "model.safetensors").symlink_to(tmp_path / "real.safetensors")
    with pytest.raises(CheckpointError, match=r"model.safetensors"):  # without a manifest a link is not hasten's
        accelerator.save_state(folder)
    assert (tmp_path / "real.safetensors").is_file()


# ------------------------------ 3. without a manifest only exact checkpoint names are hasten's
USER_ENTRIES = ["model_card.md", "models/best.pt", "latest_metrics.json", "optimizer_sweep.yaml",
                "scheduler_notes.txt", "empty/", "data", "pytorch_model_fsdp_0/notes.txt", "random_states_0.pkl.bak"]


@pytest.mark.parametrize("entry,manifest", [(e, False) for e in USER_ENTRIES] + [("empty/", True), ("data", True)])
def test_user_entries_that_look_like_checkpoint_files_are_never_replaced(tmp_path, entry, manifest):
    accelerator, *_ = prepared_model_optimizer()
    folder = accelerator.save_state(tmp_path / "ck")
    if not manifest:
        (folder / "hasten_checkpoint.json").unlink()  # now laid out like Accelerate's checkpoint
    (tmp_path / "dataset").mkdir()
    if entry == "data":
        (folder / "data").symlink_to(tmp_path / "dataset")
    elif entry.endswith("/"):
        (folder / entry).mkdir()
    else:
        (folder / entry).parent.mkdir(exist_ok=True)
        (folder / entry).write_text("mine")
    with pytest.raises(CheckpointError, match=rf"already holds files .*{entry.split('/')[0]}"):
        accelerator.save_state(folder)
    assert os.path.lexists(folder / entry.rstrip("/")) and (tmp_path / "dataset").is_dir()
    assert not (folder / entry).is_file() or (folder / entry).read_text() == "mine"


def test_a_folder_with_only_accelerate_names_is_replaced(tmp_path):
    accelerator, model, optimizer = prepared_model_optimizer()
    folder = accelerator.save_state(tmp_path / "ck")
    (folder / "hasten_checkpoint.json").unlink()
    for name in ("sampler.bin", "dl_state_dict.bin", "scaler.pt", "custom_checkpoint_0.pkl"):
        (folder / name).write_bytes(b"from accelerate")
    accelerator.save_state(folder)
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert not (folder / "sampler.bin").exists() and (folder / "hasten_checkpoint.json").is_file()


# ---------------------------------------------------------------- 4. symlinked folders stay links
def test_a_symlinked_checkpoint_folder_stays_a_link(tmp_path):
    scratch = tmp_path / "scratch" / "ck"
    scratch.mkdir(parents=True)
    link = tmp_path / "ck"
    link.symlink_to(scratch)
    accelerator, model, optimizer = prepared_model_optimizer()
    for _ in range(3):
        accelerator.save_state(link)
        saved = weights_of(accelerator, model)
        accelerator.backward(model(torch.ones(2, 4)).sum())
        optimizer.step()
    assert link.is_symlink() and os.path.realpath(link) == str(scratch)
    assert (scratch / "model.safetensors").is_file() and sorted(os.listdir(tmp_path)) == ["ck", "scratch"]
    assert sorted(os.listdir(tmp_path / "scratch")) == ["ck"]
    accelerator.load_state(link)
    assert same_tensors(weights_of(accelerator, model), saved)


def test_a_symlinked_project_folder_stays_a_link(tmp_path):
    real = tmp_path / "scratch"
    real.mkdir()
    project = tmp_path / "project"
    project.symlink_to(real)
    config = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True, total_limit=1)
    accelerator, *_ = prepared_model_optimizer(project_config=config)
    for _ in range(3):
        accelerator.save_state()
    assert project.is_symlink() and sorted(os.listdir(real / "checkpoints")) == ["checkpoint_2"]


# -------------------------------------------------- 5. numbering continues after the highest one
def test_a_fresh_run_numbers_after_existing_checkpoints_and_keeps_its_own(tmp_path):
    from hasten.state import reset_state

    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, iteration=5)
    accelerator, *_ = prepared_model_optimizer(project_config=config)
    accelerator.save_state()
    accelerator.save_state()
    reset_state()
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    accelerator, model, optimizer = prepared_model_optimizer(project_config=config)
    torch.manual_seed(7)
    with torch.no_grad():
        model[0].weight.normal_()
    mine = weights_of(accelerator, model)
    assert accelerator.save_state().name == "checkpoint_7"
    assert accelerator.save_state().name == "checkpoint_8"
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_7", "checkpoint_8"]
    reset_state()
    accelerator, model, optimizer = prepared_model_optimizer(project_config=ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2))
    assert accelerator.load_state().name == "checkpoint_8"
    assert same_tensors(weights_of(accelerator, model), mine)
    accelerator.load_state(tmp_path / "checkpoints" / "checkpoint_7")  # an older one: numbering still goes on
    assert accelerator.save_state().name == "checkpoint_9"


def test_prune_never_removes_the_checkpoint_just_written(tmp_path):
    from hasten.checkpointing import prune

    root = tmp_path / "checkpoints"
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, iteration=5)
    accelerator, *_ = prepared_model_optimizer(project_config=config)
    accelerator.save_state()
    accelerator.save_state()
    (root / "checkpoint_5").rename(root / "checkpoint_0")  # an older number for a newer checkpoint
    assert prune(root, 1, keep=root / "checkpoint_0") == [root / "checkpoint_6"]
    assert sorted(os.listdir(root)) == ["checkpoint_0"]


# ------------------------------- 6. interrupted saves and rotations never block or confuse the next
SAVE_AND_DIE = """
import contextlib, sys, torch
from torch import nn
from hasten import Accelerator, ProjectConfiguration
from hasten.checkpointing import SAVE_STAGE_HOOKS, manifest
root, auto, stage, limit = sys.argv[1], sys.argv[2] == "auto", sys.argv[3], int(sys.argv[4])
config = ProjectConfiguration(project_dir=root, automatic_checkpoint_naming=auto, total_limit=limit if auto else None)
accelerator = Accelerator(project_config=config)
torch.manual_seed(0)
model = accelerator.prepare(nn.Linear(3, 3))
for _ in range(limit):
    accelerator.save_state(root + "/ck")            # complete checkpoints (automatic naming ignores the path)
with torch.no_grad():
    model.weight.add_(1.0)
def wait():
    print("AT", stage, flush=True)
    sys.stdin.readline()                            # wait here until killed
if stage == "manifest":                             # killed with the manifest half written
    real = manifest.atomic_path
    @contextlib.contextmanager
    def half(target):
        with real(target) as tmp:
            yield tmp
            if target.name == manifest.MANIFEST:
                tmp.write_text(tmp.read_text()[:20])
                wait()
    manifest.atomic_path = half
else:
    SAVE_STAGE_HOOKS.append(lambda name, folder: wait() if name == stage else None)
accelerator.save_state(root + "/ck")
print("AT end", flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("mode,stage,limit", [("named", "manifest", 1), ("auto", "manifest", 1),
                                              ("auto", "pruning", 1), ("auto", "pruning", 2)])
def test_a_kill_while_the_manifest_is_written_or_while_pruning_never_blocks_the_next_save(tmp_path, mode, stage,
                                                                                          limit):
    import signal
    import subprocess
    import sys

    from hasten.checkpointing import complete_checkpoints
    from hasten.state import reset_state

    script = tmp_path / "save.py"
    script.write_text(SAVE_AND_DIE)
    root = tmp_path / "proj"
    proc = subprocess.Popen([sys.executable, str(script), str(root), mode, stage, str(limit)], stdout=subprocess.PIPE,
                            stdin=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == f"AT {stage}"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    reset_state()
    auto = mode == "auto"
    config = ProjectConfiguration(project_dir=str(root), automatic_checkpoint_naming=auto, total_limit=limit)
    accelerator = Accelerator(project_config=config)
    torch.manual_seed(1)
    model = accelerator.prepare(nn.Linear(3, 3))
    if auto:  # only complete checkpoints count: nothing half-deleted or half-written
        assert len(complete_checkpoints(root / "checkpoints")) == limit
    accelerator.load_state(None if auto else root / "ck")
    torch.manual_seed(0)
    delta = (model.weight - nn.Linear(3, 3).weight).detach()
    assert torch.allclose(delta, torch.zeros(3, 3) if stage == "manifest" else torch.ones(3, 3))
    accelerator.save_state(None if auto else root / "ck")  # leftovers are recognised as hasten's and cleared
    names = sorted(os.listdir(root / "checkpoints" if auto else root))
    assert not [n for n in names if n.endswith((".tmp", ".old", ".pruning"))], names
    if auto:
        assert len(names) == limit, names


# ------------------------------------------------ 7. a load failing on one process fails on all
class RankFussy(Counter):
    """Refuses its saved state on process 1 only (after partly taking it, as real code does)."""

    def load_state_dict(self, state):
        self.count = -1
        if int(os.environ["RANK"]) == 1 and state["count"] == 6:
            raise KeyError("epoch")
        self.count = state["count"]


def _load_failing_on_rank_1(root: str, damage_rng: bool) -> list:
    from hasten.checkpointing.manifest import write_manifest

    accelerator, model, optimizer = prepared_model_optimizer()
    first, fussy = Counter(5), RankFussy(6)
    accelerator.register_for_checkpointing(first, fussy)
    folder = accelerator.save_state(Path(root) / "ck")
    if damage_rng and accelerator.is_main_process:  # passes its checksum, does not parse
        (folder / "random_states_1.pkl").write_bytes(b"not a pickle at all")
        write_manifest(folder, 2)
    accelerator.wait_for_everyone()
    accelerator.backward(model(torch.ones(2, 4)).sum())
    optimizer.step()
    first.count, fussy.count = 50, 60
    weights, rng = weights_of(accelerator, model), torch.get_rng_state()
    try:
        accelerator.load_state(folder, **({} if damage_rng else {"verify_checksums": True}))
        error = "loaded"
    except CheckpointError as exc:
        error = str(exc)
    restored = first.count == 50 and fussy.count == 60 and same_tensors(weights_of(accelerator, model), weights)
    accelerator.wait_for_everyone()  # both processes got here: nobody hangs in a collective
    return [error, restored and torch.equal(torch.get_rng_state(), rng)]


@pytest.mark.parametrize("damage_rng", [False, True])
def test_a_load_failing_on_one_process_raises_the_same_error_everywhere_and_restores_all(tmp_path, damage_rng):
    results = run_on_ranks(_load_failing_on_rank_1, world_size=2, args=(str(tmp_path), damage_rng), timeout=90,
                           pg_timeout=20)
    (error0, restored0), (error1, restored1) = results
    assert error0 == error1, results
    expected = r"process 1: .*random_states_1.pkl" if damage_rng else r"process 1: .*registered object #1 \(RankFussy\)"
    assert __import__("re").search(expected, error0), error0
    assert restored0 and restored1


def test_pruning_keeps_folders_it_cannot_prove_are_hasten_s(tmp_path):
    root = tmp_path / "checkpoints"
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=1)
    accelerator, *_ = prepared_model_optimizer(project_config=config)
    for _ in range(3):
        accelerator.save_state()
        if accelerator.project_configuration.iteration == 1:  # checkpoint_0: a file changed since the save
            with open(root / "checkpoint_0" / "optimizer.bin", "ab") as handle:
                handle.write(b"edited")
        if accelerator.project_configuration.iteration == 2:  # checkpoint_1: a crafted manifest
            _rewrite_manifest(root / "checkpoint_1", lambda m: m["files"].update({"../x": {"size": 1,
                                                                                          "crc32": "00000000"}}))
    with pytest.warns(UserWarning, match=r"kept .*checkpoint_\d"):
        accelerator.save_state()
    assert sorted(os.listdir(root)) == ["checkpoint_0", "checkpoint_1", "checkpoint_3"]


@pytest.mark.parametrize("name", ["/etc/passwd", "a/../../x", "./model.safetensors", "a//b", "a\\..\\b",
                                  "d/" * 16 + "x", "hasten_checkpoint.json"])
def test_every_crafted_manifest_name_is_refused_before_anything_is_read(tmp_path, name):
    accelerator, *_ = prepared_model_optimizer()
    folder = accelerator.save_state(tmp_path / "ck")
    _rewrite_manifest(folder, lambda m: m["files"].update({name: {"size": 1, "crc32": "00000000"}}))
    with pytest.raises(CheckpointError, match=r"damaged or crafted"):
        accelerator.load_state(folder)
    with pytest.raises(CheckpointError, match=r"damaged or crafted"):
        accelerator.save_state(folder)


def test_an_oversized_manifest_is_refused(tmp_path, monkeypatch):
    from hasten.checkpointing import manifest

    accelerator, *_ = prepared_model_optimizer()
    folder = accelerator.save_state(tmp_path / "ck")
    monkeypatch.setattr(manifest, "MAX_MANIFEST_BYTES", 100)
    with pytest.raises(CheckpointError, match=r"damaged or crafted \(\d+ bytes, more than a manifest ever holds"):
        accelerator.load_state(folder)


# ------------------------------- 4. numbers read back from a checkpoint are range-checked (issue 33)
def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _live_state(accelerator, model, optimizer, scheduler, loader, counter) -> dict:
    import copy

    return copy.deepcopy({"weights": weights_of(accelerator, model), "optimizer": optimizer.state_dict(),
                          "scheduler": scheduler.state_dict(), "loader": loader.state_dict(),
                          "counter": counter.count, "rng": torch.get_rng_state(),
                          "step": accelerator.step})


def _tamper(folder: Path, file: str, field: str, value) -> None:
    """Set ``field`` of ``file`` to ``value`` and re-seal the folder (a crafted checkpoint passes its checksums)."""
    from hasten.checkpointing.manifest import write_manifest

    if file == "hasten_checkpoint.json":
        _rewrite_manifest(folder, lambda m: m.update({field: value}))
        return
    state = torch.load(folder / file, weights_only=False)
    state[field] = value
    torch.save(state, folder / file)
    write_manifest(folder, 2)


def _load_tampered(root: str, file: str, field: str, value) -> list:
    import time

    accelerator = Accelerator()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    data = torch.utils.data.DataLoader(torch.randn(16, 4), batch_size=2, shuffle=True)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, data)
    counter = Counter(5)
    accelerator.register_for_checkpointing(counter)
    batches = iter(loader)
    for _ in range(2):
        accelerator.backward(model(next(batches)).pow(2).mean())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    folder = accelerator.save_state(Path(root) / "ck")
    accelerator.backward(model(next(batches)).pow(2).mean())  # the live state moves on past the checkpoint
    optimizer.step()
    scheduler.step()
    counter.count = 7
    if accelerator.is_main_process:
        _tamper(folder, file, field, value)
    accelerator.wait_for_everyone()
    before = _live_state(accelerator, model, optimizer, scheduler, loader, counter)
    start = time.perf_counter()
    try:
        accelerator.load_state(folder)
        error = "loaded"
    except Exception as exc:  # noqa: BLE001 - the test reports what was raised
        error = f"{type(exc).__name__}: {exc}"
    elapsed = time.perf_counter() - start
    unchanged = _equal(before, _live_state(accelerator, model, optimizer, scheduler, loader, counter))
    accelerator.wait_for_everyone()
    return [error, elapsed, unchanged]


TAMPERED = [  # file, field, value, what the message must say besides the file
    ("hasten_checkpoint.json", "num_processes", 100_000_000, r"'num_processes' = 100000000 is not a process count"),
    ("hasten_checkpoint.json", "num_processes", 0, r"'num_processes' = 0 is not a process count"),
    ("hasten_checkpoint.json", "num_processes", -2, r"'num_processes' = -2 is not a process count"),
    ("hasten_checkpoint.json", "num_processes", "2", r"'num_processes' = '2' is not a process count"),
    ("hasten_checkpoint.json", "num_processes", 2.0, r"'num_processes' = 2.0 is not a process count"),
    ("hasten_checkpoint.json", "num_processes", 1, r"'num_processes' = 1 does not cover the random generator files"
                                                    r" it lists \(random_states_1.pkl"),
    ("dataloader_state.bin", "samples_yielded", -8, r"'samples_yielded' = -8 is not a sample count"),
    ("dataloader_state.bin", "samples_yielded", 1000, r"'samples_yielded' = 1000 lies beyond the end of the epoch"),
    ("dataloader_state.bin", "samples_yielded", "8", r"'samples_yielded' = '8' \(str\) is not a sample count"),
    ("dataloader_state.bin", "batches_yielded", -1, r"'batches_yielded' = -1 is not a batch count"),
    ("dataloader_state.bin", "epoch", -3, r"'epoch' = -3 is not an epoch"),
    ("dataloader_state.bin", "num_processes", 0, r"'num_processes' = 0 is not a process count"),
    ("dataloader_state.bin", "global_batch_size", 0, r"'global_batch_size' = 0 is not a batch size"),
    ("dataloader_state.bin", "generator_states", [torch.zeros(7, dtype=torch.uint8)],
     r"'generator_states'\[0\] is a torch.uint8 tensor of shape \(7,\)"),
    ("scheduler.bin", "last_epoch", -5, r"'last_epoch' = -5 is not a step counter"),
    ("scheduler.bin", "_step_count", "3", r"'_step_count' = '3' is not a step counter"),
    ("scheduler.bin", "base_lrs", [0.01, 0.01], r"'base_lrs' holds 2 learning rates but the prepared scheduler has 1"),
    ("random_states_0.pkl", "step", -1, r"'step' = -1 is not a step counter"),
    ("random_states_0.pkl", "torch_manual_seed", torch.zeros(9, dtype=torch.uint8), r"Could not restore the random"),
]


@pytest.mark.serial  # asserts that the refusal is quick
@pytest.mark.parametrize("file,field,value,expected", TAMPERED, ids=[f"{t[0]}-{t[1]}-{t[2]!r:.12}" for t in TAMPERED])
def test_a_tampered_number_is_refused_quickly_on_every_rank_and_changes_nothing(tmp_path, file, field, value,
                                                                                 expected):
    results = run_on_ranks(_load_tampered, world_size=2, args=(str(tmp_path), file, field, value), timeout=120,
                           pg_timeout=30)
    (error0, elapsed0, unchanged0), (error1, elapsed1, unchanged1) = results
    assert error0 == error1 and error0.startswith("CheckpointError"), results
    assert f"{file}" in error0 and __import__("re").search(expected, error0), error0
    assert unchanged0 and unchanged1, "the failed load changed the live state"
    assert max(elapsed0, elapsed1) < 20, results  # seconds, not minutes (a crafted count sized lists before)


@pytest.mark.parametrize("field,value", [("scale", -1.0), ("scale", float("nan")), ("growth_factor", 0.5),
                                         ("backoff_factor", 2.0), ("growth_interval", 0), ("_growth_tracker", -1)])
def test_a_tampered_loss_scaler_state_is_refused_naming_the_field(tmp_path, field, value):
    from hasten.checkpointing.restore_checks import check_scaler_state

    state = torch.amp.GradScaler("cpu", init_scale=2.0**16).state_dict()
    check_scaler_state(state, tmp_path / "scaler.pt")  # the genuine state passes
    with pytest.raises(CheckpointError, match=rf"scaler.pt: field '{field}' = {value!r}"):
        check_scaler_state({**state, field: value}, tmp_path / "scaler.pt")
