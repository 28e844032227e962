"""A checkpoint loaded on another number of processes (issue 16): random generators, mid-epoch loader
positions, partial gradients, and the files a killed save leaves behind.

Ground truth: the saving run's generator states and weights, the samples an uninterrupted pass would
still yield, and the documented rule that derives a generator state for a process that saved none.
"""

from __future__ import annotations

import collections
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from hasten import Accelerator
from hasten.checkpointing import CheckpointError
from hasten.testing import run_on_ranks
from helpers.checkpoints import prepared_model_optimizer_scheduler, same_tensors, weights_of


def _save_on_ranks(root: str) -> list:
    accelerator, model, optimizer, scheduler = prepared_model_optimizer_scheduler()
    accelerator.save_state(Path(root) / "ck")
    return [torch.get_rng_state(), weights_of(accelerator, model)]


def test_two_process_checkpoint_loads_into_one_with_a_warning(tmp_path):
    saved = run_on_ranks(_save_on_ranks, world_size=2, args=(str(tmp_path),))
    accelerator, model, *_ = prepared_model_optimizer_scheduler()
    torch.manual_seed(123)
    with pytest.warns(UserWarning, match=r"saved by 2 processes and is loaded into 1: dropped .*random_states_1\.pkl"):
        accelerator.load_state(tmp_path / "ck")
    assert torch.equal(torch.get_rng_state(), saved[0][0])  # rank 0's generators
    assert same_tensors(weights_of(accelerator, model), saved[0][1])


def _load_on_ranks(folder: str) -> str:
    accelerator, *_ = prepared_model_optimizer_scheduler()
    try:
        accelerator.load_state(folder)
    except CheckpointError as exc:
        return str(exc)
    return "loaded"


def _load_rng_on_ranks(folder: str) -> tuple:
    import warnings

    accelerator, *_ = prepared_model_optimizer_scheduler()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator.load_state(folder)
    return torch.get_rng_state(), np.random.get_state()[1].copy(), [str(w.message) for w in caught]


def test_a_one_process_checkpoint_loads_into_two_with_a_derived_generator_state(tmp_path):
    import random
    import zlib

    accelerator, *_ = prepared_model_optimizer_scheduler()
    folder = accelerator.save_state(tmp_path / "ck")
    saved = torch.get_rng_state()
    (rank0, numpy0, warned0), (rank1, numpy1, warned1) = run_on_ranks(_load_rng_on_ranks, world_size=2,
                                                                      args=(str(folder),))
    assert torch.equal(rank0, saved)  # process 0 restores its own file
    # The documented rule: seed = crc32(str(rank), crc32(source's torch CPU state)), every generator seeded with it.
    seed = zlib.crc32(b"1", zlib.crc32(saved.numpy().tobytes()))
    assert torch.equal(rank1, torch.Generator().manual_seed(seed).get_state())
    assert (numpy1 == np.random.RandomState(seed).get_state()[1]).all() and not (numpy1 == numpy0).all()
    assert random.Random(seed).getstate() != random.Random(0).getstate()
    assert len([w for w in warned0 if "saved by 1 processes and is loaded into 2" in w]) == 1 and "derive" in warned0[0]
    assert not [w for w in warned1 if "saved by" in w]  # one line, from the main process


def test_a_missing_random_states_file_is_named(tmp_path):
    accelerator, *_ = prepared_model_optimizer_scheduler()
    folder = accelerator.save_state(tmp_path / "ck")
    (folder / "random_states_0.pkl").unlink()
    with pytest.raises(CheckpointError, match=r"random_states_0.pkl is missing \(the manifest .* lists it\)"):
        accelerator.load_state(folder)
    (folder / "hasten_checkpoint.json").unlink()  # a checkpoint without manifest (Accelerate's, older hasten)
    with pytest.raises(CheckpointError, match=r"random_states_0.pkl is missing .*no random_states_\*.pkl file at all"):
        accelerator.load_state(folder)


def test_a_save_killed_while_writing_files_is_cleaned_up_by_the_next_save(tmp_path):
    accelerator, *_ = prepared_model_optimizer_scheduler()
    staging = tmp_path / "ck.tmp"
    staging.mkdir()
    (staging / ".hasten_staging").touch()
    (staging / ".model.safetensors.x1y2.tmp").write_bytes(b"half")  # an unfinished atomic write
    accelerator.save_state(tmp_path / "ck")
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    (tmp_path / "ck.old").mkdir()
    (tmp_path / "ck.old" / "mine.txt").write_text("keep")
    with pytest.raises(CheckpointError, match="ck.old exists"):
        accelerator.save_state(tmp_path / "ck")
    assert (tmp_path / "ck.old" / "mine.txt").read_text() == "keep"


def _save_mid_epoch(root: str, iterable: bool = False, accumulation: int = 1) -> list[int]:
    """Two batches of 2 per process (8 of 16 samples), then a save; returns the samples used (all ranks)."""
    accelerator = Accelerator(gradient_accumulation_steps=accumulation)
    data = torch.arange(16.0)
    model = accelerator.prepare(nn.Linear(1, 1))
    loader = accelerator.prepare(torch.utils.data.DataLoader(_Stream(data) if iterable else data, batch_size=2,
                                                             shuffle=not iterable))
    seen: list[int] = []
    for i, batch in enumerate(loader):
        with accelerator.accumulate(model):
            accelerator.backward(model(batch[:, None]).sum())
        seen += accelerator.gather(batch).long().tolist()
        if i == accumulation:  # with accumulation 2: inside a window (3 micro-batches)
            accelerator.save_state(Path(root) / "mid")
            break
    return seen


class _Stream(torch.utils.data.IterableDataset):
    def __init__(self, data):
        self.data = data

    def __iter__(self):
        return iter(self.data)


def _rest_on_ranks(folder: str, batch_size: int, iterable: bool = False) -> object:
    accelerator = Accelerator()
    data = torch.arange(16.0)
    accelerator.prepare(nn.Linear(1, 1))
    loader = accelerator.prepare(torch.utils.data.DataLoader(_Stream(data) if iterable else data,
                                                             batch_size=batch_size, shuffle=not iterable))
    try:
        accelerator.load_state(folder)
    except CheckpointError as exc:
        return str(exc), loader.state_dict()["batches_yielded"]
    return [int(v) for batch in loader for v in accelerator.gather(batch).long().tolist()]


def test_a_mid_epoch_loader_position_continues_on_fewer_and_more_processes(tmp_path):
    seen = run_on_ranks(_save_mid_epoch, world_size=2, args=(str(tmp_path),))[0]
    assert len(seen) == 8
    for world, batch_size in ((1, 2), (4, 1), (3, 2)):  # 8 samples used: global batches 2, 4, 6
        rest = run_on_ranks(_rest_on_ranks, world_size=world, args=(str(tmp_path / "mid"), batch_size))[0]
        remaining = sorted(set(range(16)) - set(seen))
        if world * batch_size == 6:  # 6 does not divide 8: the pass starts mid-batch; the end is padded, as
            # the uninterrupted pass pads it, with the epoch's first samples
            assert collections.Counter(rest) - collections.Counter(remaining) == collections.Counter(seen[:4]) and len(rest) == 12
        else:
            assert sorted(rest) == remaining, (world, batch_size)


def test_a_mid_epoch_position_that_cannot_map_is_refused_on_every_rank_before_anything_changes(tmp_path):
    run_on_ranks(_save_mid_epoch, world_size=2, args=(str(tmp_path), True))
    # 8 samples of a stream were used: 3 processes reading 1 sample each cannot start a pass at sample 8.
    errors = run_on_ranks(_rest_on_ranks, world_size=3, args=(str(tmp_path / "mid"), 1, True))
    assert errors[0] == errors[1] == errors[2]
    message, position = errors[0]
    assert "data loader #0: this data loader was saved 8 samples into its epoch" in message
    assert "which its global batch size of 3 does not divide" in message and position == 0
    rest = run_on_ranks(_rest_on_ranks, world_size=2, args=(str(tmp_path / "mid"), 2, True))[0]
    assert rest == list(range(8, 16))  # the same layout continues


def test_partial_gradients_and_old_mid_epoch_states_are_refused_on_another_count(tmp_path):
    run_on_ranks(_save_mid_epoch, world_size=2, args=(str(tmp_path / "window"), False, 2))
    for world in (1, 3):
        errors = run_on_ranks(_rest_on_ranks, world_size=world, args=(str(tmp_path / "window" / "mid"), 2))
        assert all(e == errors[0] for e in errors)
        assert "inside a gradient-accumulation window" in errors[0][0], errors[0]
    # A state written by an older hasten: each process's batch count only.
    run_on_ranks(_save_mid_epoch, world_size=2, args=(str(tmp_path / "old"),))
    folder = tmp_path / "old" / "mid"
    state = torch.load(folder / "dataloader_state.bin", weights_only=True)
    for key in ("samples_yielded", "num_processes", "global_batch_size"):
        del state[key]
    state["version"] = 1
    torch.save(state, folder / "dataloader_state.bin")
    (folder / "hasten_checkpoint.json").unlink()
    errors = run_on_ranks(_rest_on_ranks, world_size=1, args=(str(folder), 2))
    assert "in the middle of an epoch by an older hasten" in errors[0][0]
    rest = run_on_ranks(_rest_on_ranks, world_size=2, args=(str(folder), 2))[0]
    assert len(rest) == 8  # on the same count the old state still loads
