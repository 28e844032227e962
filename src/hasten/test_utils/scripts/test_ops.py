"""Distributed checks of the collectives in ``hasten.utils.operations`` (Accelerate's ``test_ops.py`` name).

Every rank builds ``create_tensor(rank)`` = ``[rank*n + 1, ..., rank*n + n]`` (n = world size), so each
collective's result is known in advance on every rank. Run with
``hasten launch --num_processes 2 hasten/test_utils/scripts/test_ops.py``.
"""

from __future__ import annotations

import torch

from hasten.base.dataclasses import DistributedType
from hasten.state import PartialState
from hasten.test_utils.testing import assert_exception
from hasten.utils.operations import (
    DistributedOperationException,
    broadcast,
    copy_tensor_to_devices,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
)


def create_tensor(state: PartialState) -> torch.Tensor:
    """This rank's ``[rank*n + 1, ..., rank*n + n]``."""
    n = state.num_processes
    return (torch.arange(n, dtype=torch.float32) + 1.0 + n * state.process_index).to(state.device)


def test_gather(state: PartialState) -> None:
    result = gather(create_tensor(state))
    assert result.tolist() == list(map(float, range(1, state.num_processes**2 + 1))), result


def test_gather_object(state: PartialState) -> None:
    result = gather_object([state.process_index])
    assert result == list(range(state.num_processes)), result


def test_gather_non_contiguous(state: PartialState) -> None:
    tensor = torch.arange(12, device=state.device).view(4, 3).t()  # a transposed view is not contiguous
    assert not tensor.is_contiguous()
    result = gather(tensor)
    assert torch.equal(result, torch.cat([tensor.contiguous()] * state.num_processes)), result


def test_broadcast(state: PartialState) -> None:
    result = broadcast(create_tensor(state))
    expected = torch.arange(state.num_processes, dtype=torch.float32) + 1.0
    assert torch.equal(result.cpu(), expected), result


def test_pad_across_processes(state: PartialState) -> None:
    # rank r holds r + 1 values; everyone is padded to num_processes values, at the end or at the front
    tensor = torch.arange(state.process_index + 1, dtype=torch.float32).to(state.device) + 1
    padded = pad_across_processes(tensor)
    assert padded.shape == (state.num_processes,), padded.shape
    assert padded[: state.process_index + 1].tolist() == tensor.tolist()
    assert padded[state.process_index + 1:].tolist() == [0.0] * (state.num_processes - state.process_index - 1)
    first = pad_across_processes(tensor, pad_first=True)
    assert first[state.num_processes - state.process_index - 1:].tolist() == tensor.tolist()


def _sum_of_tensors(state: PartialState) -> torch.Tensor:
    n = state.num_processes
    return sum(torch.arange(n, dtype=torch.float32) + 1.0 + n * r for r in range(n))  # type: ignore[return-value]


def test_reduce_sum(state: PartialState) -> None:
    result = reduce(create_tensor(state), "sum")
    assert torch.allclose(result.cpu(), _sum_of_tensors(state)), result


def test_reduce_mean(state: PartialState) -> None:
    result = reduce(create_tensor(state), "mean")
    assert torch.allclose(result.cpu(), _sum_of_tensors(state) / state.num_processes), result


def test_reduce_max(state: PartialState) -> None:
    n = state.num_processes
    result = reduce(create_tensor(state), "max") if hasattr(torch.distributed.ReduceOp, "MAX") else None
    expected = torch.arange(n, dtype=torch.float32) + 1.0 + n * (n - 1)
    assert result is not None and torch.equal(result.cpu(), expected), result


def test_op_checker(state: PartialState) -> None:
    """In debug mode a collective on tensors of different shapes raises, naming the shapes (no hang)."""
    if state.distributed_type == DistributedType.NO or state.num_processes < 2:
        return
    state.debug = True
    try:
        tensor = torch.zeros(state.process_index + 1, device=state.device)
        with assert_exception(DistributedOperationException):
            gather(tensor)
        with assert_exception(DistributedOperationException):
            broadcast(tensor)
    finally:
        state.debug = False


def test_copy_tensor_to_devices(state: PartialState) -> None:
    tensor = create_tensor(state) if state.is_main_process else None
    result = copy_tensor_to_devices(tensor)
    expected = torch.arange(state.num_processes, dtype=torch.float32) + 1.0
    assert torch.equal(result.cpu(), expected), result


TESTS = [test_gather, test_gather_object, test_gather_non_contiguous, test_broadcast, test_pad_across_processes,
         test_reduce_sum, test_reduce_mean, test_reduce_max, test_op_checker, test_copy_tensor_to_devices]


def main() -> None:
    state = PartialState()
    state.print(f"State: {state}")
    for test in TESTS:
        state.print(f"testing {test.__name__.removeprefix('test_').replace('_', ' ')}")
        test(state)
    state.print("All operations checks passed.")


if __name__ == "__main__":
    main()
