"""Index assignment of the sharding samplers: Accelerate's expectation tables, plus fast path == generic path."""

import random

import pytest
import torch
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

from hasten.data import BatchSamplerShard, IterableDatasetShard, SeedableRandomSampler, SkipBatchSampler
from hasten.data.samplers import iter_no_split, iter_split
from hasten.exceptions import ConfigurationError


def R(start, stop):  # noqa: N802 - short helper for the tables
    return list(range(start, stop))


def _full(n, bs):
    """Batches of range(n) dealt round-robin to 2 ranks (the common prefix of most tables)."""
    batches = [R(i, min(i + bs, n)) for i in range(0, n, bs)]
    return batches[0::2], batches[1::2]


# (dataset size, batch size, drop_last, even_batches, expected rank 0, expected rank 1) -- no split, 2 processes.
NO_SPLIT = [
    (24, 3, False, True, [R(0, 3), R(6, 9), R(12, 15), R(18, 21)], [R(3, 6), R(9, 12), R(15, 18), R(21, 24)]),
    (24, 3, True, True, [R(0, 3), R(6, 9), R(12, 15), R(18, 21)], [R(3, 6), R(9, 12), R(15, 18), R(21, 24)]),
    (21, 3, False, True, [R(0, 3), R(6, 9), R(12, 15), R(18, 21)], [R(3, 6), R(9, 12), R(15, 18), R(0, 3)]),
    (21, 3, True, True, [R(0, 3), R(6, 9), R(12, 15)], [R(3, 6), R(9, 12), R(15, 18)]),
    (22, 3, False, True, [R(0, 3), R(6, 9), R(12, 15), R(18, 21)], [R(3, 6), R(9, 12), R(15, 18), [21, 0, 1]]),
    (22, 3, True, True, [R(0, 3), R(6, 9), R(12, 15)], [R(3, 6), R(9, 12), R(15, 18)]),
    (20, 3, False, True, [R(0, 3), R(6, 9), R(12, 15), [18, 19, 0]], [R(3, 6), R(9, 12), R(15, 18), [1, 2, 3]]),
    (20, 3, True, True, [R(0, 3), R(6, 9), R(12, 15)], [R(3, 6), R(9, 12), R(15, 18)]),
    (2, 3, False, True, [[0, 1, 0]], [[1, 0, 1]]),
    (2, 3, True, True, [], []),
    (24, 3, False, False, [R(0, 3), R(6, 9), R(12, 15), R(18, 21)], [R(3, 6), R(9, 12), R(15, 18), R(21, 24)]),
    (24, 3, True, False, [R(0, 3), R(6, 9), R(12, 15), R(18, 21)], [R(3, 6), R(9, 12), R(15, 18), R(21, 24)]),
    (21, 3, False, False, [R(0, 3), R(6, 9), R(12, 15), R(18, 21)], [R(3, 6), R(9, 12), R(15, 18)]),
    (21, 3, True, False, [R(0, 3), R(6, 9), R(12, 15)], [R(3, 6), R(9, 12), R(15, 18)]),
    (22, 3, False, False, [R(0, 3), R(6, 9), R(12, 15), R(18, 21)], [R(3, 6), R(9, 12), R(15, 18), [21]]),
    (22, 3, True, False, [R(0, 3), R(6, 9), R(12, 15)], [R(3, 6), R(9, 12), R(15, 18)]),
    (20, 3, False, False, [R(0, 3), R(6, 9), R(12, 15), [18, 19]], [R(3, 6), R(9, 12), R(15, 18)]),
    (20, 3, True, False, [R(0, 3), R(6, 9), R(12, 15)], [R(3, 6), R(9, 12), R(15, 18)]),
    (2, 3, False, False, [[0, 1]], []),
    (2, 3, True, False, [], []),
]

SPLIT_EVEN_24 = ([R(i, i + 2) for i in range(0, 24, 4)], [R(i, i + 2) for i in range(2, 24, 4)])
SPLIT = [
    (24, 4, False, True, *SPLIT_EVEN_24),
    (24, 4, True, True, *SPLIT_EVEN_24),
    (22, 4, False, True, SPLIT_EVEN_24[0], SPLIT_EVEN_24[1][:5] + [[0, 1]]),
    (22, 4, True, True, SPLIT_EVEN_24[0][:5], SPLIT_EVEN_24[1][:5]),
    (21, 4, False, True, SPLIT_EVEN_24[0][:5] + [[20, 0]], SPLIT_EVEN_24[1][:5] + [[1, 2]]),
    (21, 4, True, True, SPLIT_EVEN_24[0][:5], SPLIT_EVEN_24[1][:5]),
    (2, 4, False, True, [[0, 1]], [[0, 1]]),
    (2, 4, True, True, [], []),
    (24, 4, False, False, *SPLIT_EVEN_24),
    (22, 4, False, False, SPLIT_EVEN_24[0], SPLIT_EVEN_24[1][:5]),
    (21, 4, False, False, SPLIT_EVEN_24[0][:5] + [[20]], SPLIT_EVEN_24[1][:5]),
    (21, 4, True, False, SPLIT_EVEN_24[0][:5], SPLIT_EVEN_24[1][:5]),
    (2, 4, False, False, [[0, 1]], []),
    (2, 4, True, False, [], []),
]


class ListBatchSampler:
    """A custom batch sampler (not torch's class): exercises the generic, streaming path."""

    def __init__(self, n, batch_size, drop_last):
        self.inner = BatchSampler(range(n), batch_size, drop_last)
        self.batch_size, self.drop_last = batch_size, drop_last

    def __iter__(self):
        return iter(list(self.inner))

    def __len__(self):
        return len(self.inner)


def _check(make, expected, split, even):
    shards = [BatchSamplerShard(make(), 2, i, split_batches=split, even_batches=even) for i in range(2)]
    assert [list(s) for s in shards] == list(expected)
    if not split:
        assert [len(s) for s in shards] == [len(e) for e in expected]


@pytest.mark.parametrize("generic", [False, True], ids=["fast", "generic"])
@pytest.mark.parametrize("case", NO_SPLIT, ids=lambda c: f"n{c[0]}-bs{c[1]}-drop{c[2]}-even{c[3]}")
def test_no_split_tables(case, generic):
    n, bs, drop, even, rank0, rank1 = case
    make = (lambda: ListBatchSampler(n, bs, drop)) if generic else (lambda: BatchSampler(range(n), bs, drop))
    _check(make, (rank0, rank1), split=False, even=even)


@pytest.mark.parametrize("generic", [False, True], ids=["fast", "generic"])
@pytest.mark.parametrize("case", SPLIT, ids=lambda c: f"n{c[0]}-bs{c[1]}-drop{c[2]}-even{c[3]}")
def test_split_tables(case, generic):
    n, bs, drop, even, rank0, rank1 = case
    make = (lambda: ListBatchSampler(n, bs, drop)) if generic else (lambda: BatchSampler(range(n), bs, drop))
    _check(make, (rank0, rank1), split=True, even=even)
    assert [len(BatchSamplerShard(make(), 2, i, split_batches=True)) for i in range(2)] == [len(make())] * 2


def test_variable_batch_sizes():
    batches = [[0, 1, 2], [3, 4], [5, 6, 7, 8], [9, 10, 11], [12, 13]]
    uneven = [BatchSamplerShard(batches, 2, i, even_batches=False) for i in range(2)]
    assert [len(s) for s in uneven] == [3, 2]
    assert [list(s) for s in uneven] == [[[0, 1, 2], [5, 6, 7, 8], [12, 13]], [[3, 4], [9, 10, 11]]]
    even = [list(BatchSamplerShard(batches, 2, i)) for i in range(2)]
    assert even == [[[0, 1, 2], [5, 6, 7, 8], [12, 13]], [[3, 4], [9, 10, 11], [0, 1, 2]]]
    assert [list(BatchSamplerShard([[0, 1, 2]], 3, i)) for i in range(3)] == [[[0, 1, 2]]] * 3
    seven = [[0], [1, 2], [3, 4, 5], [6], [7, 8], [9, 10, 11], [12, 13]]
    assert [list(BatchSamplerShard(seven, 3, i)) for i in range(3)] == [
        [[0], [6], [12, 13]], [[1, 2], [7, 8], [0]], [[3, 4, 5], [9, 10, 11], [1, 2]]]


def test_split_errors_name_both_numbers():
    with pytest.raises(ConfigurationError, match=r"batch size \(3\).*number of processes \(2\)"):
        BatchSamplerShard(BatchSampler(range(20), 3, False), 2, 0, split_batches=True)
    with pytest.raises(ConfigurationError, match="split_batches"):
        BatchSamplerShard([[0, 1], [2, 3]], 2, 0, split_batches=True)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_fast_path_equals_streaming_path(world):
    # Every size/batch/drop/even/split combination: the vectorised path yields the streaming path's batches.
    for n in list(range(0, 30)) + [97]:
        for bs in (1, 2, 3, 4, 6):
            for drop in (False, True):
                for even in (False, True):
                    for rank in range(world):
                        chunks = list(BatchSampler(range(n), bs, drop))
                        fast = list(BatchSamplerShard(BatchSampler(range(n), bs, drop), world, rank, even_batches=even))
                        assert fast == list(iter_no_split(chunks, world, rank, bs, drop, even)), (n, bs, drop, even)
                        if bs % world == 0:
                            split = list(BatchSamplerShard(BatchSampler(range(n), bs, drop), world, rank, True, even))
                            assert split == list(iter_split(chunks, world, rank, bs, drop, even))


def test_fast_random_path_matches_torch_random_sampler():
    # The vectorised draw equals RandomSampler's own pass, and leaves the generator in the same state.
    for num_samples in (None, 7, 20, 33):
        g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
        ref = BatchSampler(RandomSampler(range(10), num_samples=num_samples, generator=g1), 4, False)
        shard = BatchSamplerShard(BatchSampler(RandomSampler(range(10), num_samples=num_samples, generator=g2), 4,
                                               False), 1, 0, even_batches=False)
        for _ in range(2):  # two epochs: the generator must advance identically
            assert list(shard) == list(ref)
        assert torch.equal(g1.get_state(), g2.get_state())


def test_every_sample_once_when_divisible_and_padding_from_start():
    for world in (2, 3):
        for n in range(1, 40):
            shards = [list(BatchSamplerShard(BatchSampler(range(n), 2, False), world, r)) for r in range(world)]
            assert len({len(s) for s in shards}) == 1  # even_batches: same count everywhere
            seen = sorted(i for s in shards for b in s for i in b)
            assert set(seen) == set(range(n))
            assert len(seen) - n < 2 * world  # padding is less than one global batch


def _iterable_check(dataset_factory, seed, bs, drop, world, split):
    random.seed(seed)
    reference = list(dataset_factory())
    outs = []
    for r in range(world):
        random.seed(seed)
        outs.append(list(IterableDatasetShard(dataset_factory(), bs, drop, world, r, split)))
    per = bs // world if split else bs
    assert len({len(o) for o in outs}) == 1 and len(outs[0]) % per == 0
    observed = [x for i in range(0, len(outs[0]), per) for o in outs for x in o[i:i + per]]
    if not drop:
        while len(reference) < len(observed):
            reference += reference
    assert observed == reference[:len(observed)]


class RandomLengthStream(torch.utils.data.IterableDataset):
    def __init__(self, max_length):
        self.max_length = max_length

    def __iter__(self):
        count = 0
        while count < self.max_length:
            yield count
            count += 1
            if random.random() < 0.01:
                break


@pytest.mark.parametrize("max_length", [1000, 2])
def test_iterable_dataset_shard(max_length):
    for drop in (False, True):
        for split in (False, True):
            _iterable_check(lambda: RandomLengthStream(max_length), 42, 4, drop, 2, split)


def test_iterable_shard_len_and_epoch_generator():
    assert len(IterableDatasetShard(range(9), batch_size=2, num_processes=2)) == 6
    assert len(IterableDatasetShard(range(9), batch_size=2, drop_last=True, num_processes=2)) == 4

    class WithGenerator(torch.utils.data.IterableDataset):
        generator = torch.Generator()

        def __iter__(self):
            yield from torch.randperm(6, generator=self.generator).tolist()

    shard = IterableDatasetShard(WithGenerator(), batch_size=1, num_processes=1)
    first = list(shard)  # epoch 0 without set_epoch: Accelerate raises AttributeError here
    shard.set_epoch(0)
    assert list(shard) == first
    shard.set_epoch(1)
    assert list(shard) == torch.randperm(6, generator=torch.Generator().manual_seed(1)).tolist()


def test_seedable_sampler_depends_on_seed_and_epoch_only():
    a = SeedableRandomSampler(range(50), data_seed=7)
    b = SeedableRandomSampler(range(50), data_seed=7)
    epoch0, epoch1 = list(a), list(a)  # the epoch advances after each full pass
    assert epoch0 != epoch1 and sorted(epoch0) == list(range(50))
    b.set_epoch(1)
    assert list(b) == epoch1
    b.set_epoch(0)
    assert list(b) == epoch0
    torch.manual_seed(3)
    assert SeedableRandomSampler(range(5)).initial_seed == 3


def test_skip_batch_sampler():
    sampler = SkipBatchSampler(BatchSampler(range(16), batch_size=4, drop_last=False), 2)
    assert list(sampler) == [[8, 9, 10, 11], [12, 13, 14, 15]] and len(sampler) == 2


def test_sequential_sampler_fast_path():
    shard = BatchSamplerShard(BatchSampler(SequentialSampler(range(10)), 3, False), 2, 1)
    assert list(shard) == [[3, 4, 5], [9, 0, 1]]
