"""The set-up check that ``hasten test`` runs through ``hasten launch`` on the configured processes
(Accelerate's ``test_script.py`` name; hasten's own checks).

Each check compares against a value every rank can compute alone (ground truth), so a wrong
rank/world size, a broken collective or unsynchronised RNG fails with the check's name. Add checks
to ``CHECKS``.
Run directly: ``hasten launch --cpu --num_processes 2 -m hasten.test_utils.scripts.test_script`` or by path.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from hasten.ops.collectives import broadcast, gather, gather_object, pad_across_processes, reduce
from hasten.ops.random import synchronize_rng_states
from hasten.state import PartialState

SUCCESS_LINE = "Test is a success! You are ready for your distributed training!"


def check_state(state: PartialState) -> None:
    """Ranks are 0..n-1, each exactly once, and the main process is rank 0."""
    ranks = gather_object([state.process_index])
    assert sorted(ranks) == list(range(state.num_processes)), f"ranks seen: {ranks}"
    assert state.is_main_process == (state.process_index == 0)
    assert state.is_last_process == (state.process_index == state.num_processes - 1)
    assert 0 <= state.local_process_index < max(state.num_local_processes, 1)


def check_process_control(state: PartialState) -> None:
    """``on_main_process`` / ``on_last_process`` / ``on_process`` run exactly where they should."""
    calls: list[str] = []
    state.on_main_process(lambda: calls.append("main"))()
    state.on_last_process(lambda: calls.append("last"))()
    state.on_process(lambda: calls.append("one"), process_index=state.num_processes - 1)()
    everyone = [c for per_rank in gather_object([calls]) for c in per_rank]
    expected = {"main": 1, "last": 1, "one": 1}
    counts = {name: everyone.count(name) for name in expected}
    assert counts == expected, f"process-control decorators ran {counts} times, expected {expected}"
    with state.main_process_first():
        pass  # must not deadlock


def check_split_between_processes(state: PartialState) -> None:
    """Every item goes to exactly one process, in order; padded shares have equal length."""
    items = list(range(2 * state.num_processes + 1))
    with state.split_between_processes(items) as share:
        shares = gather_object([share])
    assert [x for s in shares for x in s] == items, f"split lost or duplicated items: {shares}"
    with state.split_between_processes(torch.arange(len(items)), apply_padding=True) as share:
        padded = gather(share.contiguous().to(state.device))
    assert padded.numel() == state.num_processes * share.numel()
    assert set(padded.tolist()) == set(items)


def check_collectives(state: PartialState) -> None:
    """gather, pad_across_processes, reduce and broadcast give the values each rank can predict."""
    n, rank, dev = state.num_processes, state.process_index, state.device
    gathered = gather(torch.tensor([float(rank)], device=dev))
    assert gathered.tolist() == [float(r) for r in range(n)], f"gather gave {gathered.tolist()}"
    padded = pad_across_processes(torch.ones(rank + 1, device=dev))
    assert padded.shape[0] == n and padded[: rank + 1].sum().item() == rank + 1
    total = reduce(torch.tensor([float(rank + 1)], device=dev), reduction="sum")
    assert total.item() == n * (n + 1) / 2, f"reduce(sum) gave {total.item()}"
    value = broadcast(torch.tensor([float(rank + 7)], device=dev), from_process=0)
    assert value.item() == 7.0, f"broadcast gave {value.item()}"


def check_rng_synchronisation(state: PartialState) -> None:
    """After synchronising, every rank draws the same random numbers (torch and a generator)."""
    torch.manual_seed(1000 + state.process_index)  # deliberately different per rank
    generator = torch.Generator().manual_seed(2000 + state.process_index)
    kinds = ["torch", "generator"] + (["cuda"] if state.device.type == "cuda" else [])
    synchronize_rng_states(kinds, generator=generator)
    draws = gather_object([(torch.rand(3).tolist(), torch.rand(3, generator=generator).tolist())])
    assert all(d == draws[0] for d in draws), f"RNG states differ across ranks: {draws}"


def check_data_loader(state: PartialState) -> None:
    """A prepared loader hands every sample to exactly one process (gathered batches = the data set)."""
    from torch.utils.data import DataLoader

    from hasten.data import prepare_data_loader

    n = state.num_processes
    for shuffle in (False, True):
        numbers: Any = list(range(32 * n))  # a list is a valid map-style dataset
        loader = prepare_data_loader(DataLoader(numbers, batch_size=8, shuffle=shuffle),
                                     put_on_device=True)
        seen = torch.cat([gather(batch.to(state.device)).cpu() for batch in loader])
        assert sorted(seen.tolist()) == list(range(32 * n)), f"shuffle={shuffle}: got {seen.tolist()}"


def check_training(state: PartialState) -> None:
    """Training on all processes (batch 8 each) equals one process on the whole batch (8 x n)."""
    from torch.utils.data import DataLoader, TensorDataset

    from hasten import Accelerator

    n = state.num_processes
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32 * n, 1, generator=g)
    data = TensorDataset(x, 2 * x + 3)
    reference = torch.nn.Linear(1, 1)
    torch.nn.init.constant_(reference.weight, 0.5)
    torch.nn.init.constant_(reference.bias, -0.5)
    model = torch.nn.Linear(1, 1)
    model.load_state_dict(reference.state_dict())
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        for xb, yb in DataLoader(data, batch_size=8 * n):
            torch.nn.functional.mse_loss(reference(xb), yb).backward()
            opt_ref.step()
            opt_ref.zero_grad()
    accelerator = Accelerator()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=8))
    for _ in range(3):
        for xb, yb in loader:
            accelerator.backward(torch.nn.functional.mse_loss(model(xb), yb))
            optimizer.step()
            optimizer.zero_grad()
    trained = accelerator.unwrap_model(model)
    for mine, expected in zip(trained.parameters(), reference.parameters()):
        assert torch.allclose(mine.detach().cpu(), expected.detach(), atol=1e-5), (mine, expected)


def check_split_nested_dict(state: PartialState) -> None:
    """A dict of lists and tensors is split key by key into the same rows on each process."""
    n = state.num_processes
    data = {"a": list(range(2 * n)), "b": torch.arange(2 * n), "c": [str(i) for i in range(2 * n)]}
    with state.split_between_processes(data) as share:
        rows = gather_object([(share["a"], share["b"].tolist(), share["c"])])
    assert [x for a, _, _ in rows for x in a] == data["a"], rows
    assert all(a == b and [str(i) for i in a] == c for a, b, c in rows), rows


def check_dispatched_data_loader(state: PartialState) -> None:
    """``dispatch_batches`` (the main process reads, the others receive) and ``split_batches`` hand out the
    same samples as the plain sharded loader: the whole data set, once."""
    from torch.utils.data import DataLoader

    from hasten.data import prepare_data_loader

    n = state.num_processes
    numbers: Any = list(range(16 * n))
    for dispatch, split in ((True, False), (False, True), (True, True)):
        batch_size = 8 * n if split else 8
        loader = prepare_data_loader(DataLoader(numbers, batch_size=batch_size), put_on_device=True,
                                     dispatch_batches=dispatch, split_batches=split)
        seen = torch.cat([gather(batch.to(state.device)).cpu() for batch in loader])
        assert sorted(seen.tolist()) == numbers, f"dispatch={dispatch} split={split}: {seen.tolist()}"


def check_seedable_sampler(state: PartialState) -> None:
    """A shuffling loader draws the same permutation on every process for an epoch, and a new one after
    ``set_epoch``."""
    from torch.utils.data import DataLoader

    from hasten.data import prepare_data_loader

    torch.manual_seed(100 + state.process_index)  # different per rank: the sampler must not depend on it
    numbers: Any = list(range(8 * state.num_processes))
    loader: Any = prepare_data_loader(DataLoader(numbers, batch_size=4, shuffle=True), use_seedable_sampler=True)
    epochs = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        epochs.append(sorted(gather_object([b.tolist() for b in loader])))
    assert all(e == epochs[0] for e in gather_object([epochs[0]])), "processes shuffled differently"
    assert epochs[0] != epochs[1] or state.num_processes * 8 < 4, "set_epoch did not change the order"


def check_trigger(state: PartialState) -> None:
    """``set_trigger`` on one process makes ``check_trigger`` True everywhere, once."""
    from hasten import Accelerator

    accelerator = Accelerator()
    assert accelerator.check_trigger() is False
    if state.is_last_process:
        accelerator.set_trigger()
    assert accelerator.check_trigger() is True
    assert accelerator.check_trigger() is False


def check_reinstantiated_state(state: PartialState) -> None:
    """After ``AcceleratorState._reset_state()``, preparing with the old Accelerator raises at once,
    naming ``_reset_state`` (Accelerate's message)."""
    from hasten import Accelerator
    from hasten.state import AcceleratorState

    accelerator = Accelerator()
    AcceleratorState._reset_state()
    try:
        accelerator.prepare(torch.nn.Linear(1, 1))
    except AttributeError as error:
        assert "This happens if `AcceleratorState._reset_state()`" in str(error), error
    else:
        raise AssertionError("prepare after AcceleratorState._reset_state() did not raise")
    Accelerator()  # a fresh Accelerator repairs the shared state


# The checks run in this order; each takes the state and raises AssertionError on failure.
CHECKS: list[Callable[[PartialState], None]] = [
    check_state,
    check_process_control,
    check_split_between_processes,
    check_collectives,
    check_rng_synchronisation,
    check_data_loader,
    check_training,
    check_split_nested_dict,
    check_dispatched_data_loader,
    check_seedable_sampler,
    check_trigger,
    check_reinstantiated_state,
]


def main() -> int:
    """Run every check; print one line per check on the main process, then the success line."""
    state = PartialState()
    state.print(f"hasten sanity check: {state.num_processes} process(es), device {state.device}, "
                f"distributed type {state.distributed_type}")
    for check in CHECKS:
        try:
            check(state)
        except AssertionError as exc:
            print(f"[rank {state.process_index}] FAILED {check.__name__}: {exc}", file=sys.stderr, flush=True)
            raise
        state.print(f"  ok  {check.__name__}")
    state.wait_for_everyone()
    state.print(SUCCESS_LINE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
