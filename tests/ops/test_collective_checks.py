"""gather / gather_for_metrics / reduce / broadcast refuse inputs whose shapes or dtypes differ across
ranks, without debug mode, on every rank, and leave the process group usable afterwards."""

import pytest
import torch

from hasten import Accelerator, PartialState
from hasten.exceptions import DistributedOperationError
from hasten.utils import broadcast, gather, reduce


def _rank() -> int:
    state = PartialState()
    assert not state.debug  # the check must hold without debug mode
    return state.process_index


def _raises_naming(call, *expected: str) -> str:
    with pytest.raises(DistributedOperationError) as info:
        call()
    message = str(info.value)
    for text in expected:
        assert text in message, message
    return message


@pytest.mark.world_size(3)
def test_gather_of_different_lengths_raises_on_every_rank_and_names_each_shape():
    rank = _rank()
    t = torch.arange(4.0) if rank == 1 else torch.arange(3.0)
    _raises_naming(lambda: gather(t), "rank 0: `gather` with shape (3,) float32",
                   "rank 1: `gather` with shape (4,) float32", "rank 2: `gather` with shape (3,) float32",
                   "pad_across_processes")
    # Nothing moved and the collectives stay in step: a correct gather right after works.
    assert gather(torch.tensor([rank])).tolist() == [0, 1, 2]


@pytest.mark.world_size(2)
def test_gather_of_different_dtypes_or_structures_raises():
    rank = _rank()
    t = torch.zeros(2, dtype=torch.float32 if rank == 0 else torch.float64)
    _raises_naming(lambda: gather(t), "shape (2,) float32", "shape (2,) float64")
    nested = {"a": torch.zeros(1)} if rank == 0 else {"b": torch.zeros(1)}
    _raises_naming(lambda: gather(nested), "{'a': shape (1,) float32}", "{'b': shape (1,) float32}")


@pytest.mark.world_size(2)
def test_gather_for_metrics_of_different_shapes_raises():
    accelerator = Accelerator(cpu=True)
    preds = torch.zeros(2, 5) if accelerator.process_index == 0 else torch.zeros(2, 4)
    _raises_naming(lambda: accelerator.gather_for_metrics(preds), "shape (2, 5)", "shape (2, 4)")
    assert accelerator.gather_for_metrics(torch.ones(2)).tolist() == [1.0] * 4


@pytest.mark.world_size(2)
def test_reduce_and_broadcast_of_different_shapes_raise():
    rank = _rank()
    _raises_naming(lambda: reduce(torch.ones(2 + rank), reduction="sum"), "rank 0: `reduce(sum)` with shape (2,)",
                   "rank 1: `reduce(sum)` with shape (3,)")
    _raises_naming(lambda: reduce(torch.ones(2, dtype=torch.int64 if rank else torch.int32)), "int32", "int64")
    buffer = torch.ones(3) if rank == 0 else torch.zeros(2)
    _raises_naming(lambda: broadcast(buffer), "rank 0: `broadcast(from_process=0)` with shape (3,)",
                   "rank 1: `broadcast(from_process=0)` with shape (2,)")
    assert buffer.tolist() == ([1.0] * 3 if rank == 0 else [0.0, 0.0])  # the receiver is untouched
    assert reduce(torch.ones(2), reduction="sum").tolist() == [2.0, 2.0]


@pytest.mark.world_size(2)
def test_different_operations_with_equal_shapes_raise():
    rank = _rank()
    t = torch.ones(2)
    _raises_naming(lambda: gather(t) if rank == 0 else reduce(t), "rank 0: `gather`", "rank 1: `reduce(mean)`")


@pytest.mark.world_size(2)
def test_gather_for_metrics_of_a_tensor_on_one_process_and_objects_on_another_raises():
    accelerator = Accelerator(cpu=True)
    data = torch.ones(2) if accelerator.process_index == 0 else [0.5, 0.25]
    _raises_naming(lambda: accelerator.gather_for_metrics(data), "rank 0: `gather` with shape (2,) float32",
                   "rank 1: `gather_object` with Python objects")
    assert accelerator.gather_for_metrics([accelerator.process_index]) == [0, 1]  # still in step
