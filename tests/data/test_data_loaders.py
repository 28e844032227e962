"""Prepared loaders in one process: DataLoader identity, end-of-pass tracking, one-shot skips, exact resume,
isolation from the global RNG, bad input."""

import collections
import io

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset

from hasten.data import (
    DataLoaderDispatcher,
    DataLoaderShard,
    DataLoaderStateMixin,
    SkipDataLoader,
    prepare_data_loader,
    skip_first_batches,
)
from hasten.exceptions import ConfigurationError
from hasten.state import GradientState, PartialState
from hasten.utils import set_seed


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
            raise TypeError("no length")
        return self.n


def flat(batches):
    return [b.tolist() for b in batches]


@pytest.fixture(autouse=True)
def _state():
    PartialState()
    yield


def test_prepared_is_a_dataloader_with_right_len():
    for loader in (DataLoader(range(16), batch_size=4), DataLoader(Stream(10), batch_size=4)):
        prepared = prepare_data_loader(loader)
        assert isinstance(prepared, DataLoader) and isinstance(prepared, DataLoaderShard)
        assert isinstance(prepared, DataLoaderStateMixin)
        assert len(prepared) == len(list(prepared)) == len(loader)
    for n in (9, 10, 11, 33):
        for bs in (2, 3, 4, 5):
            for split in (False, True):
                for rank in range(2):
                    if split and bs % 2:
                        continue
                    dl = prepare_data_loader(DataLoader(Indices(n), batch_size=bs), num_processes=2,
                                             process_index=rank, split_batches=split)
                    assert len(dl) == len(list(dl)), (n, bs, split, rank)


def test_end_of_dataloader_one_batch_ahead_and_gradient_state():
    loader = DataLoaderShard(list(range(16)), batch_size=4)
    state = GradientState()
    for _ in range(2):  # also on the second pass
        for idx, _batch in enumerate(loader):
            assert loader.end_of_dataloader == (idx == 3)
            assert state.active_dataloader is loader and state.end_of_dataloader == (idx == 3)
        assert state.active_dataloader is None
    for _batch in loader:
        break  # an abandoned pass unregisters too
    assert state.active_dataloader is None
    dispatcher = DataLoaderDispatcher(range(16), batch_size=4)
    assert [dispatcher.end_of_dataloader for _ in dispatcher] == [False, False, False, True]


def test_empty_loader_yields_nothing():
    assert list(prepare_data_loader(DataLoader(Indices(0), batch_size=2))) == []  # Accelerate yields None


def test_put_on_device_and_structures():
    class Pairs(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"x": torch.tensor([float(i)]), "name": f"s{i}"}

    prepared = prepare_data_loader(DataLoader(Pairs(), batch_size=2), put_on_device=True)
    batch = next(iter(prepared))
    assert batch["x"].device == PartialState().device and batch["name"] == ["s0", "s1"]


def test_skip_first_batches_affects_only_the_next_pass():
    raw = DataLoader(list(range(16)), batch_size=4)
    skipped = skip_first_batches(raw, num_batches=2)
    assert isinstance(skipped, SkipDataLoader)
    assert flat(skipped) == [[8, 9, 10, 11], [12, 13, 14, 15]]
    assert len(flat(skipped)) == 4  # Accelerate skips again here
    assert flat(SkipDataLoader(list(range(16)), batch_size=4, skip_batches=2)) == [[8, 9, 10, 11], [12, 13, 14, 15]]
    prepared = prepare_data_loader(DataLoader(Indices(16), batch_size=4))
    prepared.set_epoch(1)
    again = skip_first_batches(prepared, num_batches=3)
    assert again is prepared and again.iteration == 1  # same loader: still registered, same epoch
    assert flat(again) == [[12, 13, 14, 15]] and len(flat(again)) == 4
    stream = prepare_data_loader(DataLoader(Stream(10), batch_size=4))
    assert flat(skip_first_batches(stream, 1)) == [[4, 5, 6, 7], [8, 9]] and len(flat(stream)) == 3
    assert flat(skip_first_batches(DataLoader(Stream(10), batch_size=4), 2)) == [[8, 9]]


def test_skipped_map_style_batches_are_not_loaded():
    loaded = []

    class Recording(Indices):
        def __getitem__(self, i):
            loaded.append(i)
            return super().__getitem__(i)

    prepared = prepare_data_loader(DataLoader(Recording(12), batch_size=4))
    skip_first_batches(prepared, 2)
    assert flat(prepared) == [[8, 9, 10, 11]] and loaded == [8, 9, 10, 11]


def _advanced(state, draws):
    """The global RNG state after ``draws`` base-seed draws (what torch's DataLoader takes per pass) from ``state``."""
    saved = torch.get_rng_state()
    torch.set_rng_state(state)
    for _ in range(draws):
        torch.empty((), dtype=torch.int64).random_()
    advanced = torch.get_rng_state()
    torch.set_rng_state(saved)
    return advanced


def test_each_fresh_pass_consumes_the_global_rng_as_accelerates_loader():
    """One draw per pass when the user's loader has no generator (torch's base seed, which Accelerate's prepared
    loader takes from the global RNG: the user's dropout masks stay the same); none with the user's own
    generator; none for a pass that continues a restored position (exact resume)."""
    for kwargs, draws in (({"shuffle": True}, 2), ({"shuffle": False}, 2),
                          ({"shuffle": True, "generator": torch.Generator()}, 0)):
        set_seed(0)
        prepared = prepare_data_loader(DataLoader(Indices(20), batch_size=3, **kwargs), num_processes=2,
                                       process_index=0)
        before = torch.get_rng_state()
        for _ in range(2):
            list(prepared)
        assert torch.equal(_advanced(before, draws), torch.get_rng_state()), kwargs
    set_seed(0)
    prepared = prepare_data_loader(DataLoader(Indices(20), batch_size=3, shuffle=True), num_processes=2,
                                   process_index=0)
    iterator = iter(prepared)
    next(iterator)
    state = prepared.state_dict()
    fresh = prepare_data_loader(DataLoader(Indices(20), batch_size=3, shuffle=True), num_processes=2,
                                process_index=0)
    fresh.load_state_dict(state)
    before = torch.get_rng_state()
    list(fresh)  # the rest of the interrupted pass
    assert torch.equal(before, torch.get_rng_state())


def test_reproducibility_from_set_seed():
    def order(seed, world):
        set_seed(seed)
        prepared = prepare_data_loader(DataLoader(list(range(12)), batch_size=1, shuffle=True),
                                       num_processes=world, process_index=0)
        return [flat(prepared), flat(prepared)]

    for world in (1, 2):
        first = order(21, world)
        assert first == order(21, world) and first != order(42, world)
        assert first[0] != first[1]  # each epoch a new order


def test_seedable_sampler_epoch_reproducible_from_seed_and_epoch():
    def epoch_order(epoch, seed=5):
        prepared = prepare_data_loader(DataLoader(Indices(30), batch_size=4, shuffle=True), use_seedable_sampler=True,
                                       data_seed=seed)
        prepared.set_epoch(epoch)
        return flat(prepared)

    assert epoch_order(3) == epoch_order(3) and epoch_order(3) != epoch_order(2)
    assert epoch_order(3) != epoch_order(3, seed=6)
    prepared = prepare_data_loader(DataLoader(Indices(30), batch_size=4, shuffle=True), use_seedable_sampler=True,
                                   data_seed=5)
    assert [flat(prepared) for _ in range(3)] == [epoch_order(e) for e in range(3)]


def _resume_case(make, stop_epoch, stop_at, epochs=3):
    """Uninterrupted run vs. a run that saves after `stop_at` batches of `stop_epoch` and resumes fresh."""
    full = [flat(loader) for loader in [make()] for _ in range(epochs)]
    loader = make()
    for _ in range(stop_epoch):
        list(loader)
    it = iter(loader)
    seen = [next(it).tolist() for _ in range(stop_at)]
    buffer = io.BytesIO()
    torch.save(loader.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    del it
    fresh = make()
    fresh.load_state_dict(state)
    rest = [flat(fresh) for _ in range(epochs - stop_epoch)]
    assert seen + rest[0] == full[stop_epoch], (stop_epoch, stop_at)
    assert rest[1:] == full[stop_epoch + 1:]


@pytest.mark.parametrize("world,rank", [(1, 0), (2, 1)])
def test_state_dict_resumes_exactly(world, rank):
    def factory(dataset, seedable=False, **kwargs):
        def make():
            torch.manual_seed(11)  # same prepare-time seed in both runs
            return prepare_data_loader(DataLoader(dataset, batch_size=3, **kwargs), num_processes=world,
                                       process_index=rank, use_seedable_sampler=seedable)
        return make

    makers = [factory(Indices(23), shuffle=True), factory(Indices(23), seedable=True, shuffle=True),
              factory(Indices(23)), factory(Stream(23)), factory(Indices(23), shuffle=True, drop_last=True)]
    for make in makers:
        length = len(make())
        for stop_epoch, stop_at in ((0, 1), (1, 2), (1, length), (0, length - 1)):
            _resume_case(make, stop_epoch, stop_at)


def _layout(dataset, world, batch_size, split=False):
    """One loader per process of a ``world``-process run (same prepare-time seed), in this one process."""
    made = []
    for rank in range(world):
        torch.manual_seed(11 + world)  # a different seed per layout: the resumed order must come from the state
        made.append(prepare_data_loader(DataLoader(dataset, batch_size=batch_size, shuffle=isinstance(dataset, Indices)),
                                        num_processes=world, process_index=rank, split_batches=split))
    return made


def _global_batches(loaders, epochs=1, limit=None):
    """Each step's samples over all processes (sorted), for ``epochs`` passes or ``limit`` steps."""
    out = []
    for _ in range(epochs):
        iterators = [iter(loader) for loader in loaders]
        try:
            for batches in zip(*iterators):
                out.append(sorted(i for b in batches for i in b.tolist()))
                if len(out) == limit:
                    return out
        finally:
            for it in iterators:
                it.close()  # an abandoned pass ends now, not when the garbage collector finds it
    return out


@pytest.mark.parametrize("dataset", [Indices(50), Stream(48)], ids=["map", "stream"])
@pytest.mark.parametrize(("world", "batch_size", "split"), [(4, 3, False), (3, 4, False), (2, 6, False),
                                                             (3, 12, True), (4, 12, True)])
def test_a_position_saved_on_two_processes_continues_on_another_count_with_the_global_batch_kept(
        dataset, world, batch_size, split):
    full = _global_batches(_layout(dataset, 2, 6), epochs=2)  # ground truth: the 2-process run, global batch 12
    saved = _layout(dataset, 2, 6)
    first = _global_batches(saved, limit=2)
    buffer = io.BytesIO()
    torch.save(saved[0].state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert (state["samples_yielded"], state["num_processes"], state["global_batch_size"]) == (24, 2, 12)
    resumed = _layout(dataset, world, batch_size, split)
    for loader in resumed:
        loader.load_state_dict(state)
    assert first + _global_batches(resumed, epochs=2) == full  # same samples in every global batch, padding too
    assert resumed[0].state_dict()["samples_yielded"] == 0 and resumed[0].state_dict()["epoch"] == 2


def test_a_position_the_global_batch_does_not_divide_starts_mid_batch_for_map_style_loaders():
    saved = _layout(Indices(50), 2, 6)
    first = [i for batch in _global_batches(saved, limit=2) for i in batch]
    state = saved[0].state_dict()
    resumed = _layout(Indices(50), 5, 2)  # global batch 10 does not divide 24
    for loader in resumed:
        loader.load_state_dict(state)
    (one,) = _global_batches(resumed, limit=1)
    middle = resumed[0].state_dict()
    assert middle["samples_yielded"] == 34 and middle["batches_yielded"] == 1
    for loader in resumed:
        loader.load_state_dict(middle)
    rest = one + [i for step in _global_batches(resumed) for i in step]
    head = [i for loader in _layout(Indices(50), 2, 6) for i in next(iter(loader)).tolist()]  # epoch's first 12
    remaining = collections.Counter(set(range(50)) - set(first))
    assert len(rest) == 30 and collections.Counter(rest) - remaining == collections.Counter(head[:4])  # padding
    again = _layout(Indices(50), 2, 6)  # saved mid-pass again: back on 2 processes at sample 34
    for loader in again:
        loader.load_state_dict(middle)
    after = remaining - collections.Counter(one)
    assert collections.Counter(i for b in _global_batches(again) for i in b) - after == collections.Counter(head[:8])


def test_a_stream_position_the_global_batch_does_not_divide_is_refused():
    saved = _layout(Stream(48), 2, 6)
    _global_batches(saved, limit=2)
    (fresh,) = _layout(Stream(48), 1, 5)
    with pytest.raises(ValueError, match=r"saved 24 samples into its epoch, which its global batch size of 5 does "
                                         r"not divide.* at 12"):
        fresh.check_state_dict(saved[0].state_dict())
    with pytest.raises(ValueError, match="global batch size of 5"):
        fresh.load_state_dict(saved[0].state_dict())
    assert fresh.state_dict()["samples_yielded"] == 0  # refused before anything changed


def test_state_dict_between_epochs_and_before_any_pass():
    loader = prepare_data_loader(DataLoader(Indices(10), batch_size=2, shuffle=True))
    assert loader.state_dict()["epoch"] == 0 and loader.state_dict()["batches_yielded"] == 0
    list(loader)
    state = loader.state_dict()
    assert state["epoch"] == 1 and state["batches_yielded"] == 0
    expected = flat(loader)
    fresh = prepare_data_loader(DataLoader(Indices(10), batch_size=2, shuffle=True))
    fresh.load_state_dict(state)
    assert fresh.iteration == 1 and flat(fresh) == expected
    with pytest.raises(ValueError, match="generator"):
        fresh.load_state_dict({"epoch": 0, "batches_yielded": 0, "generator_states": []})


def test_skip_first_batches_replaces_restored_position():
    loader = prepare_data_loader(DataLoader(Indices(12), batch_size=2))
    loader.load_state_dict({**loader.state_dict(), "batches_yielded": 2})
    assert flat(skip_first_batches(loader, 2)) == [[4, 5], [6, 7], [8, 9], [10, 11]]  # 2, not 2 + 2
    it = iter(skip_first_batches(loader, 4))
    next(it)
    assert loader.state_dict()["batches_yielded"] == 5  # counts the skipped batches


def test_split_batches_bad_batch_size():
    with pytest.raises(ConfigurationError, match=r"\(5\).*\(2\)"):
        prepare_data_loader(DataLoader(Indices(10), batch_size=5), num_processes=2, process_index=0,
                            split_batches=True)
    with pytest.raises(ConfigurationError, match=r"\(3\).*\(2\)"):
        prepare_data_loader(DataLoader(Indices(10), batch_sampler=BatchSampler(range(10), 3, False)),
                            num_processes=2, process_index=0, split_batches=True)
    with pytest.raises(ConfigurationError, match="put_on_device"):
        prepare_data_loader(DataLoader(Indices(4)), dispatch_batches=True)
    with pytest.raises(ConfigurationError, match="use_stateful_dataloader"):
        prepare_data_loader(DataLoader(Indices(4)), use_stateful_dataloader=True)


def test_set_epoch_reaches_custom_batch_sampler():
    class EpochBatchSampler(BatchSampler):
        epoch = 0

        def set_epoch(self, epoch):
            self.epoch = epoch

    sampler = EpochBatchSampler(range(16), 4, False)
    prepared = prepare_data_loader(DataLoader(list(range(16)), batch_sampler=sampler))
    prepared.set_epoch(1)
    assert sampler.epoch == 1
    sharded = prepare_data_loader(DataLoader(list(range(16)), batch_sampler=sampler), num_processes=2,
                                  process_index=0)
    sharded.set_epoch(4)
    assert sampler.epoch == 4


def test_remainder_and_total_batch_size():
    prepared = prepare_data_loader(DataLoader(Indices(9), batch_size=2), num_processes=2, process_index=0)
    assert prepared.total_batch_size == 4 and prepared.total_dataset_length == 9
    for _ in prepared:
        assert prepared.remainder == 1
    stream = prepare_data_loader(DataLoader(Stream(11, with_len=False), batch_size=2), num_processes=2,
                                 process_index=1)
    remainders = [stream.remainder for _ in stream]
    assert remainders[:-1] == [-1] * (len(remainders) - 1) and remainders[-1] == 3


def test_workers_and_persistent_workers_skip_once_and_resume():
    for persistent in (False, True):
        def make():
            torch.manual_seed(1)
            return prepare_data_loader(DataLoader(Indices(12), batch_size=2, shuffle=True, num_workers=1,
                                                  persistent_workers=persistent), num_processes=2, process_index=0)  # noqa: B023

        full = [flat(loader) for loader in [make()] for _ in range(2)]
        loader = make()
        assert flat(skip_first_batches(loader, 1)) == full[0][1:]
        assert flat(loader) == full[1]  # the skip did not stick to the worker pool
