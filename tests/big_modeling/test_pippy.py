"""Pipeline-parallel inference (``prepare_pippy``) on ``torch.distributed.pipelining``, over gloo ranks: the
pipelined model's output equals the unsplit model's, for explicit and ``"auto"`` split points."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hasten.testing import run_on_ranks


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 4)).eval()


def _pipelined(split_points, gather_output, num_chunks, batch):
    from hasten import PartialState
    from hasten.inference import prepare_pippy

    model = _model()
    x = torch.randn(batch, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x)
    chunks = num_chunks or PartialState().num_processes
    example = x[: -(-batch // chunks)]  # one micro-batch (the batch is padded to a multiple of the chunks)
    model = prepare_pippy(model, split_points=split_points, example_args=(example,), gather_output=gather_output,
                          num_chunks=num_chunks)
    with torch.no_grad():
        out = model(x)
    same = None if out is None else bool(torch.allclose(out[:batch], expected, atol=1e-6))
    return PartialState().process_index, same, model.hf_split_points


@pytest.mark.parametrize("world_size", [2, 4])
def test_auto_split_output_equals_the_unsplit_model_on_the_last_process(world_size):
    results = run_on_ranks(_pipelined, world_size=world_size, args=("auto", False, None, 8))
    assert [same for _, same, _ in results] == [None] * (world_size - 1) + [True]
    points = results[0][2]
    assert len(points) == world_size - 1 and all(r[2] == points for r in results)


@pytest.mark.parametrize("world_size", [2, 4])
def test_gather_output_gives_every_process_the_output(world_size):
    results = run_on_ranks(_pipelined, world_size=world_size, args=("auto", True, None, 8))
    assert [same for _, same, _ in results] == [True] * world_size


def test_explicit_split_points_more_chunks_and_a_padded_batch():
    results = run_on_ranks(_pipelined, world_size=2, args=(["4"], True, 4, 6))  # 6 rows padded to 8
    assert [(same, points) for _, same, points in results] == [(True, ["4"]), (True, ["4"])]


def _full_batch_example(gather_output, batches):
    """Accelerate's documented use: the example is one process's whole batch, not one micro-batch; then
    batches of other sizes (a smaller last batch) through the same prepared model."""
    from hasten import PartialState
    from hasten.inference import prepare_pippy

    model = _model()
    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randn(rows, 8, generator=generator) for rows in batches]
    with torch.no_grad():
        expected = [model(x) for x in inputs]
    model = prepare_pippy(model, split_points=["4"], example_args=(inputs[0],), gather_output=gather_output)
    same = []
    for x, want in zip(inputs, expected):
        with torch.no_grad():
            out = model(x)
        same.append(None if out is None else bool(torch.allclose(out[: len(x)], want, atol=1e-6)))
    return PartialState().process_index, same


@pytest.mark.parametrize("gather_output", [False, True])
def test_a_full_batch_example_traces_one_micro_batch_and_every_batch_size_runs(gather_output):
    results = run_on_ranks(_full_batch_example, world_size=2, args=(gather_output, [8, 8, 6, 3]))
    last = [True] * 4
    assert results == [(0, last if gather_output else [None] * 4), (1, last)]


def _wrong_number_of_points():
    from hasten.exceptions import ConfigurationError
    from hasten.inference import prepare_pippy

    try:
        prepare_pippy(_model(), split_points=["2", "4"], example_args=(torch.zeros(1, 8),))
    except ConfigurationError as error:
        return str(error)
    return "no error"


def test_split_points_must_make_one_stage_per_process():
    messages = run_on_ranks(_wrong_number_of_points, world_size=2)
    assert all("2 split points make 3 stages, but the run has 2 processes" in m for m in messages)
