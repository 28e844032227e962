"""``save_state(..., async_save=True)`` (issue 24, item 2).

Ground truths: the files of a synchronous save of the same state (byte for byte, even when training
changes the weights right after the call), the previous checkpoint's weights after a ``kill -9`` in the
background, and the same error message on every process when the background fails.
"""

from __future__ import annotations

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
from torch.utils.data import DataLoader

from hasten import Accelerator, ProjectConfiguration
from hasten.checkpointing import SAVE_STAGE_HOOKS, CheckpointError
from hasten.testing import run_on_ranks


class Progress:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def _setup(**kwargs):
    accelerator = Accelerator(**kwargs)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    loader = DataLoader(torch.randn(40, 8), batch_size=4, shuffle=True)
    accelerator.register_for_checkpointing(Progress())
    return (accelerator, *accelerator.prepare(model, optimizer, scheduler, loader))


def _step(accelerator, model, optimizer, scheduler, batch) -> None:
    accelerator.backward(model(batch).pow(2).mean())
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def _async_save_failing(accelerator, folder: Path, fail) -> pytest.ExceptionInfo[CheckpointError]:
    """An async save into ``folder`` with the stage hook ``fail``; the error wait_for_checkpoint raises."""
    SAVE_STAGE_HOOKS.append(fail)
    try:
        accelerator.save_state(folder, async_save=True)
        with pytest.raises(CheckpointError) as caught:
            accelerator.wait_for_checkpoint()
    finally:
        SAVE_STAGE_HOOKS.clear()
    return caught


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _sync_then_async(root: str) -> tuple[dict, dict]:
    accelerator, model, optimizer, scheduler, loader = _setup()
    batches = iter(loader)
    _step(accelerator, model, optimizer, scheduler, next(batches))  # mid-epoch, with optimizer state
    sync = accelerator.save_state(Path(root) / "sync")
    target = accelerator.save_state(Path(root) / "async", async_save=True)
    _step(accelerator, model, optimizer, scheduler, next(batches))  # training changes the state in place at once
    accelerator.wait_for_checkpoint()
    return _files(sync), _files(target)


@pytest.mark.parametrize("world", [1, 2])
def test_an_async_save_equals_a_sync_save_byte_for_byte(tmp_path, world):
    for sync, asynchronous in run_on_ranks(_sync_then_async, world_size=world, args=(str(tmp_path),)):
        assert sync.keys() == asynchronous.keys() and "hasten_checkpoint.json" in sync
        assert f"random_states_{world - 1}.pkl" in sync and "optimizer.bin" in sync and "dataloader_state.bin" in sync
        for name in sync:
            assert sync[name] == asynchronous[name], name


def test_saves_wait_for_each_other_and_end_training_waits(tmp_path):
    accelerator, model, optimizer, scheduler, loader = _setup(
        project_config=ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True,
                                            total_limit=2))
    stages: list[str] = []
    SAVE_STAGE_HOOKS.append(lambda stage, folder: stages.append(stage))
    try:
        for batch in list(loader)[:3]:
            _step(accelerator, model, optimizer, scheduler, batch)
            accelerator.save_state(async_save=True)
            # the previous one is published: the next save_state waited for it
            assert stages.count("published") >= accelerator.save_iteration - 1
        accelerator.end_training()
    finally:
        SAVE_STAGE_HOOKS.clear()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_1", "checkpoint_2"]  # pruned as sync
    saved = load_file(str(tmp_path / "checkpoints" / "checkpoint_2" / "model.safetensors"))
    assert torch.equal(saved["0.weight"], accelerator.unwrap_model(model)[0].weight)
    fresh, model2, *_ = _setup(project_config=ProjectConfiguration(project_dir=str(tmp_path),
                                                                    automatic_checkpoint_naming=True))
    assert fresh.load_state().name == "checkpoint_2"
    assert torch.equal(fresh.unwrap_model(model2)[0].weight, accelerator.unwrap_model(model)[0].weight)


def test_the_staging_buffers_are_reused_between_saves_and_freed_by_end_training(tmp_path):
    accelerator, model, optimizer, scheduler, loader = _setup()
    batches = iter(list(loader)[:2])  # a whole pass: no open loader iterator left when training ends
    _step(accelerator, model, optimizer, scheduler, next(batches))
    accelerator.save_state(tmp_path / "a", async_save=True)
    buffers = accelerator._background_saver.buffers
    pointers = sorted(storage.data_ptr() for _, storage in buffers._used)
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3  # weights + AdamW's 2 moments
    # + the step counters and the generators' states (the process's and the loader's: 5 KB each)
    assert state_bytes <= buffers.nbytes <= state_bytes + 4 * 5056
    _step(accelerator, model, optimizer, scheduler, next(batches))
    accelerator.save_state(tmp_path / "b", async_save=True)  # waits for "a", then copies into the same buffers
    assert sorted(storage.data_ptr() for _, storage in buffers._used) == pointers
    accelerator.wait_for_checkpoint()
    saved = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert torch.equal(saved["0.weight"], accelerator.unwrap_model(model)[0].weight)
    accelerator.end_training()
    assert buffers.nbytes == 0


def test_a_state_that_cannot_be_serialised_fails_in_the_background_naming_its_file(tmp_path):
    accelerator, model, optimizer, scheduler, loader = _setup()

    class Unpicklable:
        def state_dict(self) -> dict:
            return {"callback": lambda: None}  # deep-copies (functions are shared) but does not pickle

        def load_state_dict(self, state: dict) -> None:
            pass

    accelerator.register_for_checkpointing(Unpicklable())
    accelerator.save_state(tmp_path / "ck", async_save=True)  # serialising is no longer on this thread
    with pytest.raises(CheckpointError, match=r"nothing was published.*custom_checkpoint_1\.pkl"):
        accelerator.wait_for_checkpoint()
    assert not (tmp_path / "ck").exists()


def _failing_background(root: str) -> tuple[str, str, bool]:
    accelerator, model, optimizer, scheduler, loader = _setup()
    previous = accelerator.save_state(Path(root) / "ck")
    before = _files(previous)
    rank = accelerator.process_index

    def fail(stage: str, path: Path) -> None:
        if stage == "async_written" and rank == accelerator.num_processes - 1 and path.name.startswith("random"):
            raise OSError(28, "No space left on device", str(path))

    _step(accelerator, model, optimizer, scheduler, next(iter(loader)))
    caught = _async_save_failing(accelerator, Path(root) / "ck", fail)
    intact = _files(Path(root) / "ck") == before
    accelerator.save_state(Path(root) / "ck", async_save=True)  # the next one works and replaces it
    accelerator.wait_for_checkpoint()
    replaced = (Path(root) / "ck" / "model.safetensors").read_bytes() != before["model.safetensors"]
    return str(caught.value), replaced, intact


@pytest.mark.world_size(2)
def test_a_background_failure_is_raised_on_every_process_and_keeps_the_previous_checkpoint(tmp_path):
    message, replaced, intact = _failing_background(str(tmp_path))
    assert intact and replaced
    assert "The background save of" in message and "nothing was published; the previous checkpoint is intact" in message
    assert "process 1: " in message and "random_states_1.pkl" in message and "No space left on device" in message


KILLED_IN_BACKGROUND = textwrap.dedent("""
    import sys, threading, torch
    from torch import nn
    from hasten import Accelerator
    from hasten.checkpointing import SAVE_STAGE_HOOKS
    folder, stage = sys.argv[1], sys.argv[2]
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = accelerator.prepare(nn.Linear(3, 3))
    accelerator.save_state(folder)                          # complete
    with torch.no_grad():
        model.weight.add_(1.0)
    def pause(name, path):
        if name == stage and threading.current_thread().name == "hasten-async-save":
            print("PAUSED", flush=True)
            sys.stdin.readline()                            # the background thread waits here until killed
    SAVE_STAGE_HOOKS.append(pause)
    accelerator.save_state(folder, async_save=True)
    print("RETURNED", flush=True)                           # the loop goes on while the save is written
    sys.stdin.readline()
""")


@pytest.mark.parametrize("stage", ["async_written", "before_publish"])
def test_kill_during_a_background_save_keeps_the_previous_checkpoint(tmp_path, stage):
    script = tmp_path / "save.py"
    script.write_text(KILLED_IN_BACKGROUND)
    folder = tmp_path / "ck"
    proc = subprocess.Popen([sys.executable, str(script), str(folder), stage], stdout=subprocess.PIPE,
                            stdin=subprocess.PIPE, text=True)
    try:
        lines = {proc.stdout.readline().strip(), proc.stdout.readline().strip()}
        assert lines == {"PAUSED", "RETURNED"}
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert sorted(os.listdir(tmp_path)) == ["ck", "ck.tmp", "save.py"]
    accelerator = Accelerator()
    model = accelerator.prepare(nn.Linear(3, 3))
    accelerator.load_state(folder)
    saved = load_file(str(folder / "model.safetensors"))
    assert torch.equal(model.weight, saved["weight"])
    torch.manual_seed(0)
    assert torch.equal(saved["weight"], nn.Linear(3, 3).weight.detach())  # the first save's weights, not +1


def _local_state(model, optimizer) -> dict[str, torch.Tensor]:
    """This rank's shards of the parameters and of AdamW's state (keyed by position, not object)."""
    state = {name: p.to_local().detach().clone() for name, p in model.named_parameters()}
    params = [p for group in optimizer.optimizer.param_groups for p in group["params"]]
    for i, param in enumerate(params):
        for key, value in optimizer.optimizer.state[param].items():
            state[f"{i}.{key}"] = (value.to_local() if hasattr(value, "to_local") else value).detach().clone()
    return state


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _fsdp2_async(root: str) -> dict:
    import pickle
    import threading

    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from hasten.config.plugins.fsdp import FullyShardedDataParallelPlugin

    accelerator = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)

    def step() -> None:
        accelerator.backward(model(torch.ones(4, 6)).sum())
        optimizer.step()
        optimizer.zero_grad()

    step()
    accelerator.save_state(Path(root) / "sync")
    # DCP's file writer, wrapped: it records which thread writes, and a write off the calling thread
    # waits until training has changed the parameters and AdamW's moments in place.
    writers, trained = [], threading.Event()
    write_data = FileSystemWriter.write_data

    def recording(self, plan, planner):
        writers.append(threading.current_thread().name)
        if threading.current_thread() is not threading.main_thread():
            assert trained.wait(timeout=60)
        return write_data(self, plan, planner)

    FileSystemWriter.write_data = recording
    at_call = _local_state(model, optimizer)
    accelerator.save_state(Path(root) / "async", async_save=True)
    buffers = accelerator._background_saver.buffers
    pointers, held = sorted(storage.data_ptr() for _, storage in buffers._used), buffers.nbytes
    step()
    trained.set()
    accelerator.wait_for_checkpoint()
    FileSystemWriter.write_data = write_data
    after = _local_state(model, optimizer)
    sync, asynchronous = _files(Path(root) / "sync"), _files(Path(root) / "async")
    for files in (sync, asynchronous):
        files.pop("hasten_checkpoint.json")  # the manifest: the checksums of the .metadata files
    metadata = [name for name in sync if name.endswith(".metadata")]
    for name in metadata:  # equal but for DCP's storage_meta (the folder's path and a random save id)
        sync[name], asynchronous[name] = (vars(pickle.loads(files[name])) for files in (sync, asynchronous))
        assert sync[name].pop("storage_meta").save_id != asynchronous[name].pop("storage_meta").save_id
    accelerator.load_state(Path(root) / "async")
    loaded = _local_state(model, optimizer)

    # A failure of one rank in the background, after its model folder: every rank raises it, naming
    # the folder; no rank starts the optimizer folder alone (its collectives would hang), the
    # previous checkpoint stays, and the next save works.
    rank = accelerator.process_index

    def fail(stage: str, path: Path) -> None:
        if stage == "async_written" and rank == 1 and path.name == "pytorch_model_fsdp_0":
            raise OSError(28, "No space left on device", str(path))

    caught = _async_save_failing(accelerator, Path(root) / "async", fail)
    kept = _files(Path(root) / "async")
    kept.pop("hasten_checkpoint.json")
    step()
    accelerator.save_state(Path(root) / "async", async_save=True)
    reused = sorted(storage.data_ptr() for _, storage in buffers._used) == pointers
    accelerator.end_training()  # waits for it
    # This rank's local shards only (FSDP2 pads them to an even split), plus its generators' state
    local = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (
        [p.to_local() for p in model.parameters()]
        + [v.to_local() if hasattr(v, "to_local") else v for st in optimizer.optimizer.state.values() for v in st.values()])}
    shard = f"pytorch_model_fsdp_0/__{rank}_0.distcp"  # the weights after one more step
    return {"writers": writers, "reused": reused, "held": held, "shards": sum(local.values()),
            "full": 3 * 4 * sum(p.numel() for p in model.parameters()), "files_equal": sync == asynchronous, "metadata": len(metadata),
            "loads_the_call": _same(loaded, at_call), "training_moved": not _same(after, at_call),
            "error": str(caught.value), "previous_kept": all(asynchronous[k] == v for k, v in kept.items()
                                                             if not k.endswith(".metadata")),
            "next_published": (Path(root) / "async" / "hasten_checkpoint.json").is_file()
            and _files(Path(root) / "async")[shard] != asynchronous[shard]}


def test_an_fsdp2_sharded_async_save_stages_shards_and_writes_them_in_the_background(tmp_path):
    for result in run_on_ranks(_fsdp2_async, world_size=2, args=(str(tmp_path),)):
        # DCP's files are written by the background thread only (model, then optimizer folder) ...
        assert result["writers"] == ["hasten-async-save", "hasten-async-save"]
        # ... from the state of the call, although training changed it in place before they were written
        assert result["training_moved"] and result["loads_the_call"]
        assert result["files_equal"] and result["metadata"] == 2  # a synchronous save's files
        assert "nothing was published; the previous checkpoint is intact" in result["error"]
        assert "process 1: " in result["error"] and "No space left on device" in result["error"]
        assert result["error"].endswith("async.tmp/pytorch_model_fsdp_0'")
        assert result["previous_kept"] and result["next_published"]
        # the staging buffers hold this rank's shards (not the full state: 3x the weights with AdamW) and
        # two generators' states (5 KB each), and the next save copies into the same buffers
        assert result["shards"] < result["full"]
        assert result["shards"] <= result["held"] <= result["shards"] + 2 * 5056 and result["reused"]


KILLED_WHILE_WRITING_SHARDS = textwrap.dedent("""
    import sys, threading, torch
    from torch import nn
    from hasten import Accelerator, FullyShardedDataParallelPlugin
    from hasten.checkpointing import SAVE_STAGE_HOOKS
    accelerator = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT"))
    torch.manual_seed(0)
    linear = nn.Linear(3, 3)
    model, optimizer = accelerator.prepare(linear, torch.optim.AdamW(linear.parameters()))
    accelerator.save_state(sys.argv[1])                     # complete
    with torch.no_grad():
        model.weight.add_(1.0)
    def pause(name, path):                                  # between the model's DCP folder and the optimizer's
        if name == "async_written" and path.name == "pytorch_model_fsdp_0":
            print("PAUSED", threading.current_thread().name, flush=True)
            sys.stdin.readline()
    SAVE_STAGE_HOOKS.append(pause)
    accelerator.save_state(sys.argv[1], async_save=True)
    print("RETURNED", flush=True)
    accelerator.wait_for_checkpoint()                       # paused: only a DCP folder written elsewhere ends
    print("PUBLISHED", flush=True)
""")


def test_kill_while_the_background_writes_dcp_folders_keeps_the_previous_checkpoint(tmp_path):
    from hasten.checkpointing.dcp import read_full_state
    from hasten.checkpointing.manifest import read_manifest, verify_files

    script = tmp_path / "save.py"
    script.write_text(KILLED_WHILE_WRITING_SHARDS)
    folder = tmp_path / "ck"
    proc = subprocess.Popen([sys.executable, str(script), str(folder)], stdout=subprocess.PIPE,
                            stdin=subprocess.PIPE, text=True)
    try:
        lines = {proc.stdout.readline().strip(), proc.stdout.readline().strip()}
        assert lines == {"PAUSED hasten-async-save", "RETURNED"}
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    staged = tmp_path / "ck.tmp"
    assert (staged / "pytorch_model_fsdp_0" / ".metadata").is_file()  # killed halfway through the DCP folders
    assert not (staged / "optimizer_0").exists()
    manifest = read_manifest(folder)
    verify_files(folder, manifest, manifest["files"])  # the previous checkpoint: every file as published
    torch.manual_seed(0)
    first = nn.Linear(3, 3)
    saved = read_full_state(folder / "pytorch_model_fsdp_0")
    assert torch.equal(saved["weight"], first.weight.detach())  # the first save's weights, not +1
