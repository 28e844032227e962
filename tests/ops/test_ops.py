"""Collectives and tree helpers with 1, 2 and 3 ranks, checked against values computed locally."""

from collections import namedtuple

import pytest
import torch

from hasten import PartialState
from hasten.utils import (
    broadcast,
    broadcast_object_list,
    concatenate,
    find_batch_size,
    gather,
    gather_object,
    pad_across_processes,
    recursively_apply,
    reduce,
    send_to_device,
)

WORLD_SIZES = [1, pytest.param(2, marks=pytest.mark.world_size(2)), pytest.param(3, marks=pytest.mark.world_size(3))]
Pair = namedtuple("Pair", ["a", "b"])


def _rank_world():
    state = PartialState()
    return state.process_index, state.num_processes


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_gather_nested_and_scalars(n):
    rank, world = _rank_world()
    assert world == n
    data = {"x": torch.full((2, 3), float(rank)), "y": [torch.tensor(rank), Pair(torch.ones(1) * rank, torch.arange(2))]}
    out = gather(data)
    assert torch.equal(out["x"], torch.cat([torch.full((2, 3), float(r)) for r in range(n)]))
    assert torch.equal(out["y"][0], torch.arange(n)) if n > 1 else out["y"][0].ndim == 0
    assert isinstance(out["y"][1], Pair)
    assert torch.equal(out["y"][1].b, torch.arange(2).repeat(n))


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_gather_object_flattens_one_level(n):
    rank, world = _rank_world()
    assert gather_object([f"r{rank}", {"k": rank}]) == [x for r in range(n) for x in (f"r{r}", {"k": r})]


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_broadcast_in_place(n):
    rank, _ = _rank_world()
    src = n - 1
    data = [torch.full((3,), float(rank)), {"z": torch.tensor([rank, rank])}]
    out = broadcast(data, from_process=src)
    assert out[0] is data[0]
    assert torch.equal(data[0], torch.full((3,), float(src)))
    assert torch.equal(data[1]["z"], torch.tensor([src, src]))
    objs = [rank, f"from {rank}"] if rank == src else [None, None]
    broadcast_object_list(objs, from_process=src)
    assert objs == [src, f"from {src}"]


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_reduce(n):
    rank, _ = _rank_world()
    t = torch.tensor([float(rank + 1), 10.0 * rank])
    expected_sum = torch.tensor([float(sum(range(1, n + 1))), 10.0 * sum(range(n))])
    assert torch.allclose(reduce(t, "sum"), expected_sum)
    assert torch.allclose(reduce(t), expected_sum / n)  # utils.reduce defaults to mean
    assert torch.equal(reduce(t, "max"), torch.tensor([float(n), 10.0 * (n - 1)]))
    assert torch.allclose(reduce({"a": t}, "sum", scale=2.0)["a"], 2 * expected_sum)
    assert torch.equal(t, torch.tensor([float(rank + 1), 10.0 * rank]))  # input untouched


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_pad_across_processes_uneven(n):
    rank, _ = _rank_world()
    t = torch.arange(rank + 1, dtype=torch.float32).reshape(1, rank + 1) + 1  # shape (1, rank+1)
    padded = pad_across_processes({"t": [t]}, dim=1, pad_index=-1)["t"][0]
    assert padded.shape == (1, n)
    assert padded[0, : rank + 1].tolist() == (torch.arange(rank + 1) + 1.0).tolist()
    assert padded[0, rank + 1 :].tolist() == [-1.0] * (n - rank - 1)
    first = pad_across_processes(torch.ones(rank + 1), pad_index=0, pad_first=True)
    assert first.tolist() == [0.0] * (n - rank - 1) + [1.0] * (rank + 1)
    gathered = gather(pad_across_processes(torch.ones(rank + 1), dim=-1))
    assert gathered.shape == (n * n,)
    assert gathered.sum().item() == sum(range(1, n + 1))
    labels = torch.arange(rank + 1)  # Trainer.evaluate pads 1-d labels along dim=1: unchanged, no collective
    assert pad_across_processes({"labels": labels, "logits": t}, dim=1)["labels"] is labels


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_split_between_processes(n):
    state = PartialState()
    rank = state.process_index
    items = list(range(7))
    with state.split_between_processes(items) as part:
        parts = gather_object([part])
    assert [x for p in parts for x in p] == items
    with state.split_between_processes(items, apply_padding=True) as part:
        assert len(part) == -(-7 // n)
    tensor = torch.arange(10).reshape(5, 2)
    with state.split_between_processes({"a": tensor, "b": list("abcde")}, apply_padding=True) as part:
        assert part["a"].shape[0] == -(-5 // n)
        assert len(part["b"]) == -(-5 // n)
        assert part["b"][0] == "abcde"[min(rank * (5 // n) + min(rank, 5 % n), 4)]
    with state.split_between_processes(("x", "y")) as part:
        assert isinstance(part, tuple)


def test_split_bad_input():
    state = PartialState()
    with pytest.raises(TypeError, match="set"):
        with state.split_between_processes({1, 2}):
            pass
    with pytest.raises(ValueError, match="same length"):
        with state.split_between_processes({"a": [1], "b": [1, 2]}):
            pass


def test_gather_and_pad_bad_input():
    PartialState()
    with pytest.raises(TypeError, match="str"):
        gather({"a": "text"})
    labels = torch.zeros(16)
    assert pad_across_processes(labels, dim=1) is labels  # out of range: unchanged, as in Accelerate
    assert pad_across_processes({"x": labels}, dim=-2)["x"] is labels
    with pytest.raises(ValueError, match="reduction='avg'"):
        reduce(torch.ones(1), "avg")


def test_tree_helpers():
    data = {"a": [torch.ones(4, 2), Pair(torch.zeros(4), "keep")], "b": 3}
    doubled = recursively_apply(lambda t: t * 2, data)
    assert isinstance(doubled["a"][1], Pair) and doubled["a"][1].b == "keep" and doubled["b"] == 3
    assert find_batch_size(data) == 4
    moved = send_to_device(data, "cpu", skip_keys="b")
    assert moved["a"][0].device.type == "cpu"
    cat = concatenate([{"x": torch.ones(1)}, {"x": torch.zeros(2)}])
    assert cat["x"].tolist() == [1.0, 0.0, 0.0]
    with pytest.raises(TypeError, match="Unsupported type str"):
        recursively_apply(lambda t: t, {"a": "s"}, error_on_other_type=True)
