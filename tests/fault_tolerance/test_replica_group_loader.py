"""Item 2 of issue 38: the replica groups read one global order at one cursor, so an epoch sees every sample once
even when steps do not commit and a group is lost and comes back (the loader against a scripted quorum; the real
torchft run is in test_replica_groups_launch.py)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from hasten.exceptions import ConfigurationError
from hasten.fault_tolerance.data import ReplicaGroupLoader


class _Manager:
    def __init__(self) -> None:
        self.committed = 0

    def batches_committed(self) -> int:
        return self.committed


class _Group:
    """What the loader reads of a ReplicaGroup: the cursor of the step's quorum."""

    def __init__(self) -> None:
        self.manager = _Manager()
        self.index, self.participants, self.num_groups = 0, 1, 2
        self.steps_committed = self.steps_retried = 0  # the optimizer steps taken (a loader's micro-batch clock)

    def cursor(self) -> tuple[int, int, int]:
        return self.manager.committed, self.index, self.participants


def _loader(group: _Group, size: int, rank: int = 0, ranks: int = 1) -> ReplicaGroupLoader:
    data = DataLoader(TensorDataset(torch.arange(size)), batch_size=2, shuffle=True,
                      generator=torch.Generator().manual_seed(3))
    return ReplicaGroupLoader(data, lambda: group, rank, ranks, None)


def _run_epoch(size: int, schedule: dict[int, Any]) -> tuple[Counter[int], int]:
    """Two groups of two ranks in lockstep; ``schedule[step]`` is "drop" (no commit), "lose" (group 1 gone),
    "back" (group 1 heals from group 0). Returns the committed samples' counts and the number of steps."""
    groups = [_Group(), _Group()]
    loaders = {(g, r): _loader(groups[g], size, r, 2) for g in range(2) for r in range(2)}
    iterators = {key: iter(loader) for key, loader in loaders.items()}
    live, seen, step = [0, 1], Counter[int](), 0
    while True:
        event = schedule.get(step)
        if event == "lose":
            live = [0]
        elif event == "back":  # a new process: fresh loaders that load the live peer's state (torchft's heal)
            groups[1] = _Group()
            groups[1].manager.committed = groups[0].manager.committed
            for r in range(2):
                loaders[(1, r)] = _loader(groups[1], size, r, 2)
                loaders[(1, r)].load_state_dict(loaders[(0, r)].state_dict())
                iterators[(1, r)] = iter(loaders[(1, r)])
            live = [0, 1]
        for position, g in enumerate(live):
            groups[g].index, groups[g].participants = position, len(live)
        batches = {}
        for g in live:
            for r in range(2):
                batch = next(iterators[(g, r)], None)
                batches[(g, r)] = None if batch is None else (batch[0].tolist(), loaders[(g, r)].padded)
        if all(batch is None for batch in batches.values()):
            return seen, step
        assert None not in batches.values(), "every live group ends the epoch at the same step"
        for g in live:  # every live group steps: a vote that commits, or one that does not
            if event == "drop":
                groups[g].steps_retried += 1
            else:
                groups[g].steps_committed += 1
                groups[g].manager.committed += len(live)
        if event != "drop":
            for ids, padded in batches.values():
                if not padded:
                    seen.update(ids)
        step += 1


def test_every_sample_once_without_failures() -> None:
    seen, steps = _run_epoch(64, {})
    assert sorted(seen) == list(range(64)) and set(seen.values()) == {1}
    assert steps == 8  # 64 samples / (2 groups x 2 ranks x 2 per batch)


def test_every_sample_once_with_a_dropped_step_and_a_lost_group() -> None:
    seen, steps = _run_epoch(64, {2: "drop", 3: "lose", 6: "drop", 7: "back"})
    assert sorted(seen) == list(range(64)), sorted(set(range(64)) - set(seen))
    assert set(seen.values()) == {1}, [i for i, n in seen.items() if n > 1]
    assert steps > 8


def test_ragged_end_pads_and_says_so() -> None:
    group = _Group()
    group.participants = 1
    loader = _loader(group, 5)
    ids, padded = [], []
    for (batch,) in loader:
        ids.append(batch.tolist())
        padded.append(loader.padded)
        group.manager.committed += 1
        group.steps_committed += 1
    assert padded == [False, False, True]
    assert sorted(sum(ids[:2], []) + ids[2][:1]) == list(range(5))
    assert loader.epoch == 1 and loader.epoch_start == 3


def test_accumulation_reads_consecutive_micro_batches_once() -> None:
    group = _Group()
    group.participants = 2
    loaders = [ReplicaGroupLoader(DataLoader(TensorDataset(torch.arange(32)), batch_size=2), lambda g=g: g, 0, 1,
                                  None, accumulation_steps=lambda: 2) for g in (group, _Group())]
    other = loaders[1]._replica_group()
    other.index, other.participants = 1, 2
    iterators, seen = [iter(loader) for loader in loaders], []
    for _step in range(4):
        for _micro in range(2):
            for iterator in iterators:
                seen.extend(next(iterator)[0].tolist())
        for g in (group, other):  # optimizer.step(): one commit per step, over both participants
            g.steps_committed += 1
            g.manager.committed += 2
    assert sorted(seen) == list(range(32))
    assert all(next(iterator, None) is None for iterator in iterators)


def test_batches_without_an_optimizer_step_are_refused() -> None:
    group = _Group()
    loader = ReplicaGroupLoader(DataLoader(TensorDataset(torch.arange(32)), batch_size=2), lambda: group, 0, 1, None)
    iterator = iter(loader)
    next(iterator)
    with pytest.raises(ConfigurationError, match="without an optimizer.step"):
        next(iterator)


def test_a_state_loaded_at_another_cursor_resumes_at_its_position() -> None:
    """save_state's loader state, loaded in a new launch (whose torchft cursor starts again at 0) or later in the
    same run, continues with the batch after the saved step, not at the epoch's start or past its end."""
    first = _Group()
    loader = _loader(first, 40)
    read: list[list[int]] = []
    state: dict[str, int] = {}
    batches = iter(loader)
    for _ in range(10):
        read.append(next(batches)[0].tolist())
        first.steps_committed += 1
        first.manager.committed += 1
        if len(read) == 4:
            state = loader.state_dict()
    second = _Group()  # a new run: nothing committed yet
    resumed = _loader(second, 40)
    resumed.load_state_dict(state)
    again: list[list[int]] = []
    batches = iter(resumed)
    for _ in range(6):
        again.append(next(batches)[0].tolist())
        second.steps_committed += 1
        second.manager.committed += 1
    assert again == read[4:10]
