"""Distributed checks of batch sizes at the end of the data and of ``join_uneven_inputs`` (Accelerate's
``test_distributed_data_loop.py`` name; hasten's own checks). Run with
``hasten launch --num_processes 2 hasten/test_utils/scripts/test_distributed_data_loop.py``.

The data sets hold ``3 * num_processes - 1`` samples, so with batch size 1 the last round leaves one
process without a real sample: ``even_batches`` pads it, ``even_batches=False`` does not.
"""

from __future__ import annotations

import pickle
import warnings
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from hasten.accelerator import Accelerator
from hasten.state import AcceleratorState
from hasten.utils import DataLoaderConfiguration, gather_object


class DummyIterableDataset(IterableDataset):  # type: ignore[type-arg]
    def __init__(self, data: list[int]) -> None:
        self.data = data

    def __iter__(self) -> Any:
        yield from self.data


def create_accelerator(even_batches: bool = True) -> Accelerator:
    AcceleratorState._reset_state(True)
    return Accelerator(dataloader_config=DataLoaderConfiguration(even_batches=even_batches))


def create_dataloader(accelerator: Accelerator, size: int, batch_size: int, iterable: bool = False) -> Any:
    data: Any = DummyIterableDataset(list(range(size))) if iterable else list(range(size))
    return accelerator.prepare(DataLoader(data, batch_size=batch_size))


def batches_per_process(accelerator: Accelerator, loader: Any) -> list[list[int]]:
    """Each process's batch sizes, in process order."""
    return gather_object([[len(batch) for batch in loader]])


def test_default_ensures_even_batch_sizes(n: int) -> None:
    accelerator = create_accelerator()
    sizes = batches_per_process(accelerator, create_dataloader(accelerator, 3 * n - 1, 1))
    rounds = -(-(3 * n - 1) // n)
    assert all(s == [1] * rounds for s in sizes), sizes  # the last round is padded for everyone
    sizes = batches_per_process(accelerator, create_dataloader(accelerator, 3 * n - 1, 2))
    assert len({len(s) for s in sizes}) == 1, sizes


def test_can_disable_even_batches(n: int) -> None:
    accelerator = create_accelerator(even_batches=False)
    sizes = batches_per_process(accelerator, create_dataloader(accelerator, 3 * n - 1, 1))
    expected = [2] + [3] * (n - 1) if n > 1 else [2]
    assert sorted(len(s) for s in sizes) == expected, sizes  # the last process gets one batch fewer
    assert sum(sum(s) for s in sizes) == 3 * n - 1


def test_can_join_uneven_inputs(n: int) -> None:
    accelerator = create_accelerator(even_batches=False)
    model = accelerator.prepare(torch.nn.Linear(1, 1))
    loader = create_dataloader(accelerator, 3 * n - 1, 1)
    steps = 0
    with accelerator.join_uneven_inputs([model]):
        for batch in loader:  # the process with fewer batches joins instead of hanging the others
            model(batch.float().view(-1, 1).to(accelerator.device)).sum().backward()
            steps += 1
    assert sorted(gather_object([steps])) == ([2] + [3] * (n - 1) if n > 1 else [2])


def test_join_can_override_even_batches(n: int) -> None:
    if n == 1:
        return  # one process: loaders are not sharded, join_uneven_inputs does nothing
    accelerator = create_accelerator(even_batches=True)
    model = accelerator.prepare(torch.nn.Linear(1, 1))
    train = create_dataloader(accelerator, 3 * n - 1, 1)
    valid = create_dataloader(accelerator, 3 * n - 1, 1)
    with accelerator.join_uneven_inputs([model], even_batches=False):
        assert train.batch_sampler.even_batches is False and valid.batch_sampler.even_batches is False
    assert train.batch_sampler.even_batches is True and valid.batch_sampler.even_batches is True


def test_join_warns_for_iterable_loaders_when_overriding(n: int) -> None:
    if n == 1:
        return
    accelerator = create_accelerator()
    model = accelerator.prepare(torch.nn.Linear(1, 1))
    create_dataloader(accelerator, 3 * n - 1, 1, iterable=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with accelerator.join_uneven_inputs([model], even_batches=False):
            pass
    assert any("only supported for map-style datasets" in str(w.message) for w in caught), caught


def test_pickle_accelerator(n: int) -> None:
    accelerator = create_accelerator()
    restored = pickle.loads(pickle.dumps(accelerator))
    assert restored.num_processes == n and restored.process_index == accelerator.process_index


def test_data_loader_covers_the_data_once(n: int) -> None:
    accelerator = create_accelerator(even_batches=False)
    loader = create_dataloader(accelerator, 4 * n + 1, 2)
    seen = sorted(x for batches in gather_object([[b.tolist() for b in loader]]) for b in batches for x in b)
    assert seen == list(range(4 * n + 1)), seen


TESTS = [test_default_ensures_even_batch_sizes, test_can_disable_even_batches, test_can_join_uneven_inputs,
         test_join_can_override_even_batches, test_join_warns_for_iterable_loaders_when_overriding,
         test_pickle_accelerator, test_data_loader_covers_the_data_once]


def main() -> None:
    n = create_accelerator().num_processes
    for test in TESTS:
        create_accelerator().print(f"**{test.__name__.replace('_', ' ')}**")
        test(n)
    accelerator = create_accelerator()
    accelerator.print("All data loop checks passed.")
    AcceleratorState._reset_state(True)


if __name__ == "__main__":
    main()
