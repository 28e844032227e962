"""Prepared loaders on 2 and 3 gloo ranks: gather_for_metrics coverage, shuffling agreement, dispatching,
exact resume."""

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from hasten.data import gather_for_metrics, prepare_data_loader, skip_first_batches
from hasten.ops import broadcast_object_list, gather_object
from hasten.state import PartialState
from hasten.utils import set_seed

WORLDS = [pytest.param(2, marks=pytest.mark.world_size(2)), pytest.param(3, marks=pytest.mark.world_size(3))]


class Indices(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor(i)


class Stream(IterableDataset):
    def __init__(self, n, with_len=True):
        self.n, self.with_len = n, with_len

    def __iter__(self):
        return (torch.tensor(i) for i in range(self.n))

    def __len__(self):
        if not self.with_len:
            raise TypeError("a stream without length")
        return self.n


def _datasets(n):
    return {"map": lambda: Indices(n), "shuffled": lambda: Indices(n), "iterable": lambda: Stream(n),
            "stream-no-len": lambda: Stream(n, with_len=False)}


def _evaluate(loader, use_objects):
    out = []
    for batch in loader:
        if use_objects:
            out += gather_for_metrics(batch.tolist(), use_gather_object=True)
        else:
            out += gather_for_metrics(batch).tolist()
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_gather_for_metrics_returns_each_sample_once(world):
    # Every combination runs inside this one multi-rank body (fast: no process start per case).
    state = PartialState()
    assert state.num_processes == world
    failures = []
    for n in (9, 10, 11, 33):
        for bs in (2, 3, 4, 5):
            for kind, make in _datasets(n).items():
                for dispatch in (False, True):
                    for split in (False, True):
                        if split and bs % world:
                            continue
                        loader = DataLoader(make(), batch_size=bs, shuffle=kind == "shuffled")
                        prepared = prepare_data_loader(loader, put_on_device=True, dispatch_batches=dispatch,
                                                       split_batches=split)
                        got = _evaluate(prepared, use_objects=(n + bs) % 4 == 0)
                        if sorted(got) != list(range(n)):
                            failures.append((n, bs, kind, dispatch, split, got))
    assert not failures, failures[:3]


@pytest.mark.world_size(2)
def test_shuffle_agreed_across_ranks_and_equal_to_single_process():
    state = PartialState()
    torch.manual_seed(100 + state.process_index)  # ranks disagree on purpose: the seed is agreed at prepare
    prepared = prepare_data_loader(DataLoader(Indices(32), batch_size=4, shuffle=True), put_on_device=True)
    before = torch.get_rng_state()
    epochs = [[b.tolist() for b in prepared] for _ in range(3)]
    after = torch.get_rng_state()
    torch.set_rng_state(before)
    for _ in range(3):  # one base-seed draw per pass, as Accelerate's loader (torch's DataLoader) takes
        torch.empty((), dtype=torch.int64).random_()
    assert torch.equal(after, torch.get_rng_state())
    everyone = gather_object([epochs])
    global_orders = [[i for pair in zip(everyone[0][e], everyone[1][e]) for b in pair for i in b] for e in range(3)]
    assert all(sorted(order) == list(range(32)) for order in global_orders)
    assert global_orders[0] != global_orders[1] != global_orders[2]
    if state.process_index == 0:  # rank 0 alone, from the same RNG state, shuffles the same way
        torch.manual_seed(100)
        single = prepare_data_loader(DataLoader(Indices(32), batch_size=8, shuffle=True), num_processes=1,
                                     process_index=0)
        assert [[i for b in single for i in b.tolist()] for _ in range(3)] == global_orders


@pytest.mark.world_size(2)
def test_seedable_epochs_reproducible_and_set_epoch_changes_order():
    state = PartialState()
    set_seed(3)

    def order(epoch):
        prepared = prepare_data_loader(DataLoader(Indices(24), batch_size=3, shuffle=True), put_on_device=True,
                                       use_seedable_sampler=True, data_seed=9)
        prepared.set_epoch(epoch)
        mine = [b.tolist() for b in prepared]
        parts = gather_object([mine])
        return [i for pair in zip(*parts) for b in pair for i in b]

    assert order(2) == order(2) and order(2) != order(1)
    assert sorted(order(4)) == list(range(24))
    if state.process_index == 0:
        single = prepare_data_loader(DataLoader(Indices(24), batch_size=6, shuffle=True), num_processes=1,
                                     process_index=0, use_seedable_sampler=True, data_seed=9)
        single.set_epoch(2)
        assert [i for b in single for i in b.tolist()] == order(2)
    else:
        order(2)


@pytest.mark.world_size(2)
def test_dispatcher_slices_rounds_and_carries_non_tensors():
    rank = PartialState().process_index
    prepared = prepare_data_loader(DataLoader(Stream(10), batch_size=2), put_on_device=True)
    assert type(prepared).__name__ == "DataLoaderDispatcher" and isinstance(prepared, DataLoader)
    expected = {0: [[0, 1], [4, 5], [8]], 1: [[2, 3], [6, 7], [9]]}[rank]
    assert [b.tolist() for b in prepared] == expected and len(prepared) == 3

    def collate(items):
        return {"x": torch.stack(items), "tag": "batch"}

    tagged = prepare_data_loader(DataLoader(Stream(8), batch_size=2, collate_fn=collate), put_on_device=True)
    batches = list(tagged)
    assert all(b["tag"] == "batch" for b in batches) and len(batches) == 2


@pytest.mark.world_size(2)
def test_resume_on_two_ranks_equals_uninterrupted_run():
    def make(dispatch):
        set_seed(5)
        return prepare_data_loader(DataLoader(Indices(27), batch_size=2, shuffle=True), put_on_device=True,
                                   dispatch_batches=dispatch)

    for dispatch in (False, True):
        loader = make(dispatch)
        full = [[b.tolist() for b in loader] for _ in range(3)]
        loader = make(dispatch)
        it = iter(loader)
        seen = [next(it).tolist() for _ in range(3)]
        saved = [loader.state_dict()]
        broadcast_object_list(saved)  # the Accelerator saves rank 0's state and loads it everywhere
        del it
        fresh = make(dispatch)
        fresh.load_state_dict(saved[0])
        assert seen + [b.tolist() for b in fresh] == full[0], dispatch
        assert [b.tolist() for b in fresh] == full[1], dispatch
        assert [b.tolist() for b in skip_first_batches(fresh, 6)] == full[2][6:]  # the next pass only


@pytest.mark.world_size(2)
def test_split_and_per_rank_batches_match_single_process_global_batches():
    rank = PartialState().process_index
    for split, bs in ((False, 8), (True, 16)):
        set_seed(42)
        prepared = prepare_data_loader(DataLoader(Indices(64), batch_size=bs, shuffle=True), put_on_device=True,
                                       split_batches=split)
        mine = [b.tolist() for b in prepared]
        both = gather_object([mine])
        if rank == 0:
            set_seed(42)
            single = prepare_data_loader(DataLoader(Indices(64), batch_size=16, shuffle=True), num_processes=1,
                                         process_index=0)
            assert [a + b for a, b in zip(*both)] == [b.tolist() for b in single]
