"""Per-step throughput: hasten vs hand-written DDP vs Accelerate, on the same work, in one invocation.

Two workloads: the tutorial's BasicNet CNN (compute-bound) and a tiny MLP (where per-step overhead
dominates). Two settings: 2 gloo ranks (hasten / DDP+DistributedSampler / Accelerate with cpu=True,
which it needs under torchrun on a CPU-only machine) and 1 process (hasten / plain PyTorch /
Accelerate). Each measurement is a fresh set of forked ranks; frameworks are interleaved and the
median of --repeats runs is reported with its ratio to the hand-written baseline.

    .venv/bin/python benchmarks/bench_training.py --repeats 5 --rounds 30
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from hasten.testing import run_on_ranks


class BasicNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        return F.log_softmax(self.fc2(F.relu(self.fc1(torch.flatten(x, 1)))), dim=1)


def tiny_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10), nn.LogSoftmax(dim=1))


WORKLOADS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], int, int]] = {
    # name: (model factory, sample shape, batch per process, measured steps)
    "cnn": (BasicNet, (1, 28, 28), 32, 40),
    "mlp": (tiny_mlp, (32,), 32, 2000),  # ~0.5 s per run: 400 steps (0.1 s) left the ratio to scheduling noise
}
WARMUP = 5


def _dataset(shape: tuple[int, ...], n: int) -> TensorDataset:
    # Callers size it one batch beyond the loop: prepared loaders (hasten's, Accelerate's) read one batch
    # ahead to flag the last one, and reading past the end makes torch's RandomSampler draw and list a
    # second full permutation (~1 ms at this size) inside the timed loop, which the hand-written loop,
    # stopping exactly at the end, would never pay. A real epoch pays it in both.
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, *shape, generator=g), torch.randint(0, 10, (n,), generator=g))


class Setup:
    """One framework's prepared training objects, and a method that runs ``steps`` steps of its loop."""

    def __init__(self, model: nn.Module, optimizer: Any, loader: Any, backward: Callable[[Any], None],
                 barrier: Callable[[], None]) -> None:
        self.model, self.optimizer, self.backward, self.barrier = model, optimizer, backward, barrier
        self.batches = iter(loader)

    def run(self, steps: int) -> None:
        model, optimizer, backward, batches = self.model, self.optimizer, self.backward, self.batches
        for _ in range(steps):
            x, y = next(batches)
            backward(F.nll_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()

    def timed(self, steps: int) -> float:
        """Steps per second over ``steps`` steps, between two barriers (all ranks start and end together)."""
        self.barrier()
        start = time.perf_counter()
        self.run(steps)
        self.barrier()
        return steps / (time.perf_counter() - start)


def _no_barrier() -> None:
    return None


def build_plain(workload: str, distributed: bool, steps: int) -> Setup:
    factory, shape, batch, _ = WORKLOADS[workload]
    torch.manual_seed(0)
    model = factory()
    data = _dataset(shape, batch * (steps + WARMUP + 1) * (2 if distributed else 1))
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
        loader = DataLoader(data, batch_size=batch, sampler=DistributedSampler(data, shuffle=True, seed=0))
        barrier: Callable[[], Any] = torch.distributed.barrier
    else:
        loader = DataLoader(data, batch_size=batch, shuffle=True)
        barrier = _no_barrier
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    return Setup(model, optimizer, loader, lambda loss: loss.backward(), barrier)


def _prepared(accelerator: Any, workload: str, steps: int) -> Setup:
    """The workload's model, SGD optimizer and shuffled loader, prepared by ``accelerator`` (hasten's or Accelerate's)."""
    factory, shape, batch, _ = WORKLOADS[workload]
    torch.manual_seed(0)
    model = factory()
    data = _dataset(shape, batch * (steps + WARMUP + 1) * accelerator.num_processes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(data, batch_size=batch, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    return Setup(model, optimizer, loader, accelerator.backward, accelerator.wait_for_everyone)


def build_hasten(workload: str, distributed: bool, steps: int) -> Setup:
    from hasten import Accelerator

    return _prepared(Accelerator(), workload, steps)


def build_accelerate(workload: str, distributed: bool, steps: int) -> Setup:
    from accelerate import Accelerator as HFAccelerator

    accelerator = HFAccelerator(cpu=True)  # without cpu=True it trains each rank alone on a CPU-only box
    assert accelerator.num_processes == (2 if distributed else 1)
    return _prepared(accelerator, workload, steps)


BUILDERS: dict[str, Callable[[str, bool, int], Setup]] = {
    "hand-written": build_plain, "hasten": build_hasten, "accelerate": build_accelerate}


def run_alone(name: str, workload: str, distributed: bool) -> float:
    """One framework in this (fresh) process: warm-up, then steps/s over the workload's step count."""
    steps = WORKLOADS[workload][3]
    setup = BUILDERS[name](workload, distributed, steps)
    setup.run(WARMUP)
    return setup.timed(steps)


def run_paired(names: list[str], workload: str, distributed: bool, rounds: int) -> dict[str, list[float]]:
    """Every framework built in this one process, then timed in alternating blocks.

    Each round times one block of steps per framework, in an order that reverses every round (A B C, C B A,
    ...), so slow drift of the machine and cache effects of switching hit every framework alike; block
    ``r`` of two frameworks ran within a fraction of a second of each other, and the ratio of their rates
    is one paired sample. Fresh processes per run (``run_alone``) compare runs seconds apart, whose
    machine-level noise (10-15% on this VM) hides a 1% difference however many runs are taken.
    """
    steps = WORKLOADS[workload][3]
    block = max(1, steps // 10)
    setups = {name: BUILDERS[name](workload, distributed, block * rounds) for name in names}
    for setup in setups.values():
        setup.run(WARMUP)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            rates[name].append(setups[name].timed(block))
    return rates


def _in_fresh_process(fn: Callable[..., Any], *args: Any, distributed: bool) -> Any:
    if distributed:
        return run_on_ranks(fn, world_size=2, args=args, timeout=600)[0]
    return run_on_ranks(_single, world_size=1, args=(fn, *args), timeout=600)[0]


def _single(fn: Callable[..., Any], *args: Any) -> Any:
    torch.set_num_threads(2)  # one process may use both cores
    return fn(*args)


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    return q1, q2, q3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="fresh-process runs per framework")
    parser.add_argument("--rounds", type=int, default=30, help="alternating blocks per framework in the paired runs")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    parser.add_argument("--quick", action="store_true", help="one short repeat: checks the script works (not a measurement)")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.rounds = 1, 2
    names = ["hand-written", "hasten"]
    try:
        import accelerate  # noqa: F401

        names.append("accelerate")
    except ImportError:
        print("accelerate is not installed: `pip install accelerate` to include it")
    for workload in args.workloads:
        for distributed in (True, False):
            setting = "2 gloo ranks" if distributed else "1 process"
            results: dict[str, list[float]] = {name: [] for name in names}
            for _ in range(args.repeats):  # --repeats 0: the paired runs only
                for name in names:  # interleaved, so drift hits everyone alike
                    results[name].append(_in_fresh_process(run_alone, name, workload, distributed,
                                                           distributed=distributed))
            if args.repeats:
                base = statistics.median(results["hand-written"])
                print(f"\n{workload} ({setting}), fresh processes, steps/s, median of {args.repeats}:")
                for name, values in results.items():
                    median = statistics.median(values)
                    print(f"  {name:13s} {median:8.2f}  ({median / base:.3f}x hand-written)   runs: "
                          + ", ".join(f"{v:.1f}" for v in values))
            rates = _in_fresh_process(run_paired, names, workload, distributed, args.rounds, distributed=distributed)
            print(f"\n{workload} ({setting}), paired in one process, {args.rounds} alternating blocks of "
                  f"{max(1, WORKLOADS[workload][3] // 10)} steps; ratio = median of per-block ratios (quartiles):")
            for name in names:
                ratios = [a / b for a, b in zip(rates[name], rates["hand-written"])]
                q1, q2, q3 = _quartiles(ratios)
                print(f"  {name:13s} {statistics.median(rates[name]):8.2f}  ({q2:.3f}x hand-written, "
                      f"quartiles {q1:.3f}-{q3:.3f})")


if __name__ == "__main__":
    main()
