"""Pipeline schedules' numerics over forked gloo ranks: every schedule x pp 2 and 4 x accumulation 1 and 2 x
{mean loss, token-normalised loss with padding} gives every parameter's gradient within 1e-6 of one process
running the same model on the same data, and the loss within 1e-6 relative. The cases of one world size
share one start-up; each run is bounded by the harness's deadline and the process group's timeout.
Also: where each schedule places its stages, and the combinations refused at ``prepare``."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from hasten.testing import run_on_ranks

SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
MULTI = {"Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"}
BATCH, SEQ, WIDTH, VOCAB, UNITS = 8, 5, 8, 6, 9


class _OwnTokenLoss(nn.Module):
    """A model computing its own token-normalised loss, as transformers' models do with ``num_items_in_batch``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _model()

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None,
                num_items_in_batch: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.body(x)
        return logits if labels is None else _token_loss(logits, labels, num_items_in_batch)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(UNITS - 1)]
    return nn.Sequential(*blocks, nn.Linear(WIDTH, VOCAB))


def _split_points(stages: int, prefix: str = "") -> list[str]:
    return [f"{prefix}{round(UNITS * i / stages)}" for i in range(1, stages)]


def _mean_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def _token_loss(logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch: torch.Tensor | None) -> torch.Tensor:
    """The sum over the non-padding tokens (-100 is padding) divided by the count over the whole window."""
    total = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction="sum")
    return total / num_items_in_batch


def _batches(kind: str, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(count):
        x = torch.randn(BATCH, SEQ, WIDTH, generator=generator)
        if kind == "mean":
            y = torch.randn(BATCH, SEQ, VOCAB, generator=generator)
        else:  # each row padded after its own length (1..SEQ tokens): micro-batches hold unequal token counts
            y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
            lengths = torch.randint(1, SEQ + 1, (BATCH,), generator=generator)
            y[torch.arange(SEQ).expand(BATCH, SEQ) >= lengths[:, None]] = -100
        batches.append((x, y))
    return batches


def _window_items(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """transformers' ``num_items_in_batch``: the non-padding labels over the accumulation window."""
    return sum((y != -100).sum() for _, y in batches)  # type: ignore[return-value]


def _reference(kind: str, accumulation: int, own_loss: bool = False):
    """One process, without hasten: each batch's loss, and the gradients after the window (Accelerate's
    ``backward`` divides each loss by the accumulation steps)."""
    model = _OwnTokenLoss() if own_loss else _model()
    batches, losses = _batches(kind, accumulation), []
    items = _window_items(batches) if kind == "token" else None
    for x, y in batches:
        if own_loss:
            loss = model(x, labels=y, num_items_in_batch=items)
        else:
            loss = _mean_loss(model(x), y) if kind == "mean" else _token_loss(model(x), y, items)
        (loss / accumulation).backward()
        losses.append(loss.item())
    return losses, {name: p.grad.clone() for name, p in model.named_parameters()}


def _pipelined(schedule: str, kind: str, accumulation: int, own_loss: bool = False):
    """This process's share of the same window under ``schedule``: (losses, this process's gradients)."""
    from hasten import Accelerator, ParallelismConfig
    from hasten.state import PartialState, reset_state

    reset_state()
    processes = PartialState().num_processes
    stages = processes * (2 if schedule in MULTI else 1)
    config = ParallelismConfig(pp_size=processes, pp_schedule=schedule, pp_microbatches=2 * processes,
                               pp_split_points=_split_points(stages, "body." if own_loss else ""))
    accelerator = Accelerator(parallelism_config=config, cpu=True, gradient_accumulation_steps=accumulation)
    model = _OwnTokenLoss() if own_loss else _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    extra = {} if own_loss else {"loss_fn": _mean_loss if kind == "mean" else _token_loss}
    model, optimizer = accelerator.prepare(model, optimizer, **extra)
    batches, losses = _batches(kind, accumulation), []
    items = {"num_items_in_batch": _window_items(batches)} if kind == "token" else {}
    for x, y in batches:
        with accelerator.accumulate(model):
            loss = model(x, labels=y, **items)
            accelerator.backward(loss)
        losses.append(loss.item())
    grads = {name: p.grad.clone() for name, p in accelerator.unwrap_model(model).named_parameters()}
    return losses, grads


def _cases():
    return [(schedule, accumulation) for schedule in SCHEDULES for accumulation in (1, 2)]


def _every_case(kind: str):
    return [_pipelined(schedule, kind, accumulation) for schedule, accumulation in _cases()]


def _check(kind: str, results, want, label: str) -> None:
    losses, want_grads = want
    grads: dict[str, torch.Tensor] = {}
    for rank_losses, rank_grads in results:
        assert rank_losses == pytest.approx(losses, rel=1e-6, abs=0), label  # on every process
        assert not set(rank_grads) & set(grads), label  # each parameter on exactly one process
        grads.update(rank_grads)
    assert sorted(grads) == sorted(want_grads), label
    for name, grad in want_grads.items():
        assert torch.allclose(grads[name], grad, rtol=0, atol=1e-6), (label, name, (grads[name] - grad).abs().max())


@pytest.mark.parametrize("kind", ["mean", "token"])
@pytest.mark.parametrize("processes", [2, 4])
def test_every_schedule_and_accumulation_gives_one_processs_gradients_and_loss(processes, kind):
    per_rank = run_on_ranks(_every_case, world_size=processes, args=(kind,), timeout=400, pg_timeout=30)
    for index, (schedule, accumulation) in enumerate(_cases()):
        want = _reference(kind, accumulation)
        _check(kind, [rank[index] for rank in per_rank], want, f"{schedule} pp={processes} accumulation={accumulation}")


def _own_loss_cases():
    return [_pipelined(schedule, "token", 2, own_loss=True) for schedule in ("ZBVZeroBubble", "Interleaved1F1B")]


def test_a_model_computing_its_own_token_loss_gets_the_labels_and_count_on_its_last_stage():
    """Under a V placement process 0 holds the first and the last stage: only the last gets the labels."""
    want = _reference("token", 2, own_loss=True)
    per_rank = run_on_ranks(_own_loss_cases, world_size=2, timeout=200, pg_timeout=30)
    for index, schedule in enumerate(("ZBVZeroBubble", "Interleaved1F1B")):
        _check("token", [rank[index] for rank in per_rank], want, schedule)


def test_stages_are_placed_round_robin_or_in_a_v():
    from hasten.strategies.pipeline_schedules import local_stages

    assert [local_stages("Interleaved1F1B", 4, 8, rank) for rank in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [local_stages("LoopedBFS", 2, 6, rank) for rank in range(2)] == [[0, 2, 4], [1, 3, 5]]
    assert [local_stages("ZBVZeroBubble", 4, 8, rank) for rank in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [local_stages("DualPipeV", 2, 4, rank) for rank in range(2)] == [[0, 3], [1, 2]]
    assert [local_stages("1F1B", 4, 4, rank) for rank in range(4)] == [[0], [1], [2], [3]]
    from hasten import ParallelismConfig

    # stages per process: from the split points when given, else what the schedule needs at least
    assert ParallelismConfig(pp_size=2, pp_schedule="ZBVZeroBubble").pipeline_stages_per_process == 2
    assert ParallelismConfig(pp_size=2, pp_schedule="GPipe").pipeline_stages_per_process == 1
    assert ParallelismConfig(pp_size=2, pp_schedule="LoopedBFS",
                             pp_split_points=list("abcde")).pipeline_stages_per_process == 3


# ------------------------------------------------------------------------------------------ refusals
REFUSALS = [
    # (schedule, split points, micro-batches, batch rows, what the message says)
    ("DualPipeV", 3, 2, 8, "DualPipeV needs pp_microbatches >= 4"),
    ("Interleaved1F1B", 3, 5, 10, "torch's schedule refuses it"),
    ("InterleavedZeroBubble", 3, 5, 10, "torch's schedule refuses it"),
    ("ZBVZeroBubble", 5, 2, 8, "places exactly two stages per process (in a V): pp_size=2 needs 3 split points"),
    ("GPipe", 3, 2, 8, "runs one stage per process: pp_size=2 needs 1 split points, got 3"),
    ("LoopedBFS", 2, 2, 8, "do not divide evenly over pp_size=2"),
    ("1F1B", 1, 2, 8, "takes no num_items_in_batch argument"),  # a mean loss_fn called with a count
]


def _refusals():
    from hasten import Accelerator, ParallelismConfig
    from hasten.exceptions import ConfigurationError
    from hasten.state import reset_state

    outcomes = []
    for schedule, points, microbatches, rows, _ in REFUSALS:
        reset_state()
        started = time.monotonic()
        config = ParallelismConfig(pp_size=2, pp_schedule=schedule, pp_microbatches=microbatches,
                                   pp_split_points=_split_points(points + 1))
        accelerator = Accelerator(parallelism_config=config, cpu=True)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(rows, WIDTH)), batch_size=rows)
        try:
            model, _ = accelerator.prepare(_model(), loader, loss_fn=_mean_loss)
            if schedule == "1F1B":
                model(torch.zeros(rows, WIDTH), labels=torch.zeros(rows, VOCAB), num_items_in_batch=torch.tensor(3))
            outcomes.append(("no error", time.monotonic() - started))
        except ConfigurationError as error:
            outcomes.append((str(error), time.monotonic() - started))
    return outcomes


@pytest.mark.serial
def test_combinations_a_schedule_cannot_run_are_refused_at_prepare_within_5_s():
    """(And a loss that cannot take the item count, at the call.)"""
    for outcomes in run_on_ranks(_refusals, world_size=2, timeout=200, pg_timeout=30):
        for (schedule, _, _, _, message), (text, seconds) in zip(REFUSALS, outcomes):
            assert message in text, (schedule, text)
            assert seconds < 5, (schedule, seconds)


# ------------------------------------------------------------------------------------------ checkpoints
def _saved_under(schedule: str, folder: str):
    """One SGD-with-momentum step under ``schedule``, then ``save_state``: the full model's weights."""
    from hasten import Accelerator, ParallelismConfig
    from hasten.state import PartialState

    processes = PartialState().num_processes
    config = ParallelismConfig(pp_size=processes, pp_schedule=schedule, pp_microbatches=2 * processes,
                               pp_split_points=_split_points(2 * processes))
    accelerator = Accelerator(parallelism_config=config, cpu=True)
    model = _model()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                           loss_fn=_mean_loss)
    x, y = _batches("mean", 1)[0]
    accelerator.backward(model(x, labels=y))
    optimizer.step()
    optimizer.zero_grad()
    accelerator.save_state(folder)
    return accelerator.get_state_dict(model)


def _loaded_on_one_process(folder: str):
    """Load the checkpoint without a pipeline, take one more step: (weights after load, after the step)."""
    from hasten import Accelerator

    accelerator = Accelerator(cpu=True)
    model = _model()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    accelerator.load_state(folder)
    loaded = {name: p.detach().clone() for name, p in model.named_parameters()}
    x, y = _batches("mean", 2)[1]
    accelerator.backward(_mean_loss(model(x), y))
    optimizer.step()
    return loaded, {name: p.detach().clone() for name, p in model.named_parameters()}


def test_a_checkpoint_saved_under_a_v_schedule_resumes_on_one_process(tmp_path):
    """Process 0 holds stages 0 and 3 (a V): the checkpoint still has every key once, and the momentum."""
    folder = str(tmp_path / "checkpoint")
    saved = run_on_ranks(_saved_under, world_size=2, args=("ZBVZeroBubble", folder), timeout=200, pg_timeout=30)[0]
    loaded, stepped = run_on_ranks(_loaded_on_one_process, world_size=1, args=(folder,), timeout=200)[0]
    model = _model()  # the uninterrupted run on one process
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in _batches("mean", 2):
        _mean_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert sorted(saved) == sorted(loaded) == sorted(name for name, _ in model.named_parameters())
    for name, weight in loaded.items():
        assert torch.equal(weight, saved[name]), name
    for name, weight in model.named_parameters():
        assert torch.allclose(stepped[name], weight.detach(), rtol=0, atol=1e-6), name


# ------------------------------------------------------------------------------------------ PP x DDP
def _pp_x_ddp(schedule: str):
    """pp 2 x dp_replicate 2: each replica reads half of every step's batch; two SGD steps."""
    from hasten import Accelerator, ParallelismConfig

    config = ParallelismConfig(pp_size=2, dp_replicate_size=2, pp_schedule=schedule, pp_microbatches=2,
                               pp_split_points=_split_points(4))
    accelerator = Accelerator(parallelism_config=config, cpu=True)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = (torch.cat(parts) for parts in zip(*_batches("mean", 2)))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH // 2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader, loss_fn=_mean_loss)
    for inputs, labels in loader:
        accelerator.backward(model(inputs, labels=labels))
        optimizer.step()
        optimizer.zero_grad()
    weights = {name: p.detach().clone() for name, p in accelerator.unwrap_model(model).named_parameters()}
    return int(accelerator.torch_device_mesh.get_local_rank("dp_replicate")), weights


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "Interleaved1F1B"])
def test_two_stages_per_process_times_two_replicas_equal_one_process_on_the_whole_batch(schedule):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _batches("mean", 2):
        _mean_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    by_replica: dict[int, dict[str, torch.Tensor]] = {0: {}, 1: {}}
    for replica, weights in run_on_ranks(_pp_x_ddp, world_size=4, args=(schedule,), timeout=300, pg_timeout=30):
        by_replica[replica].update(weights)
    for weights in by_replica.values():
        assert sorted(weights) == sorted(name for name, _ in model.named_parameters())
        for name, weight in model.named_parameters():
            assert torch.allclose(weights[name], weight.detach(), rtol=0, atol=1e-6), (schedule, name)


def _default_microbatches():
    from hasten import Accelerator, ParallelismConfig

    config = ParallelismConfig(pp_size=2, pp_split_points=_split_points(2))  # pp_microbatches follows pp_size
    accelerator = Accelerator(parallelism_config=config, cpu=True)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_batches("mean", 1)[0]), batch_size=BATCH)
    model, loader = accelerator.prepare(_model(), loader, loss_fn=_mean_loss)
    x, y = next(iter(loader))
    loss = model(x, labels=y)
    accelerator.backward(loss)
    return loss.item()


def test_a_data_loader_is_prepared_when_pp_microbatches_is_left_to_follow_pp_size():
    x, y = _batches("mean", 1)[0]
    want = _mean_loss(_model()(x), y).item()
    assert run_on_ranks(_default_microbatches, world_size=2, timeout=200, pg_timeout=30) == pytest.approx([want] * 2,
                                                                                                        rel=1e-6)


# ----------------------------------------------------------------------------------------------- evaluation
def _evaluated_under_every_schedule():
    """Per schedule: a training micro-step (its gradients kept), then evaluation without and with labels; the
    outputs, the loss, the gradients after evaluation, and the rows each linear layer of this process saw."""
    from hasten import Accelerator, ParallelismConfig
    from hasten.state import reset_state

    results = []
    for schedule in SCHEDULES:
        reset_state()
        stages = 2 * (2 if schedule in MULTI else 1)
        config = ParallelismConfig(pp_size=2, pp_schedule=schedule, pp_microbatches=4,
                                   pp_split_points=_split_points(stages))
        accelerator = Accelerator(parallelism_config=config, cpu=True)
        model = accelerator.prepare(_model(), loss_fn=_mean_loss)
        x, y = _batches("mean", 1)[0]
        accelerator.backward(model(x, labels=y))
        rows: set[int] = set()
        for module in accelerator.unwrap_model(model).modules():
            if isinstance(module, nn.Linear):
                module.register_forward_pre_hook(lambda _, args, seen=rows: seen.add(args[0].shape[0]))
        model.eval()
        with torch.no_grad():
            outputs, loss = model(x), model(x, labels=y)
        grads = {name: p.grad.clone() for name, p in accelerator.unwrap_model(model).named_parameters()}
        results.append((outputs, loss.item(), grads, rows))
    return results


def test_evaluation_runs_the_micro_batches_through_the_schedules_stages_and_equals_one_process():
    """Forward only over 4 micro-batches of 2 rows (pipelined, also under the V placements), the output and
    loss on every process as one process computes them, and the gradients held from training untouched."""
    model = _model()
    x, y = _batches("mean", 1)[0]
    _mean_loss(model(x), y).backward()
    with torch.no_grad():
        want_outputs = model(x)
    per_rank = run_on_ranks(_evaluated_under_every_schedule, world_size=2, timeout=300, pg_timeout=30)
    for index, schedule in enumerate(SCHEDULES):
        for outputs, loss, grads, rows in (rank[index] for rank in per_rank):
            assert rows == {BATCH // 4}, schedule
            assert torch.allclose(outputs, want_outputs, rtol=0, atol=1e-6), schedule
            assert loss == pytest.approx(_mean_loss(want_outputs, y).item(), rel=1e-6), schedule
            for name, grad in grads.items():
                assert torch.allclose(grad, model.get_parameter(name).grad, rtol=0, atol=1e-6), (schedule, name)
