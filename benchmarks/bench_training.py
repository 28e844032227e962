"""Per-step throughput: hasten vs hand-written DDP vs Accelerate, on the same work, in one invocation.

Two workloads: the tutorial's BasicNet CNN (compute-bound) and a tiny MLP (where per-step overhead
dominates). Two settings: 2 gloo ranks (hasten / DDP+DistributedSampler / Accelerate with cpu=True,
which it needs under torchrun on a CPU-only machine) and 1 process (hasten / plain PyTorch /
Accelerate). Each measurement is a fresh set of forked ranks; frameworks are interleaved and the
median of --repeats runs is reported with its ratio to the hand-written baseline.

    .venv/bin/python benchmarks/bench_training.py --repeats 5
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


def _timed_loop(model: nn.Module, optimizer: Any, loader: Any, steps: int, backward: Callable[[Any], None],
                barrier: Callable[[], None]) -> float:
    it = iter(loader)
    for _ in range(WARMUP):
        x, y = next(it)
        backward(F.nll_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    barrier()
    start = time.perf_counter()
    for _ in range(steps):
        x, y = next(it)
        backward(F.nll_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    barrier()
    return steps / (time.perf_counter() - start)


def run_plain(workload: str, distributed: bool) -> float:
    factory, shape, batch, steps = WORKLOADS[workload]
    torch.manual_seed(0)
    model = factory()
    data = _dataset(shape, batch * (steps + WARMUP + 1) * (2 if distributed else 1))
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
        loader = DataLoader(data, batch_size=batch, sampler=DistributedSampler(data, shuffle=True, seed=0))
        barrier = torch.distributed.barrier
    else:
        loader = DataLoader(data, batch_size=batch, shuffle=True)

        def barrier() -> None:
            return None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    return _timed_loop(model, optimizer, loader, steps, lambda loss: loss.backward(), barrier)


def run_hasten(workload: str, distributed: bool) -> float:
    from hasten import Accelerator

    factory, shape, batch, steps = WORKLOADS[workload]
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = factory()
    data = _dataset(shape, batch * (steps + WARMUP + 1) * accelerator.num_processes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(data, batch_size=batch, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    return _timed_loop(model, optimizer, loader, steps, accelerator.backward, accelerator.wait_for_everyone)


def run_accelerate(workload: str, distributed: bool) -> float:
    from accelerate import Accelerator as HFAccelerator

    factory, shape, batch, steps = WORKLOADS[workload]
    accelerator = HFAccelerator(cpu=True)  # without cpu=True it trains each rank alone on a CPU-only box
    assert accelerator.num_processes == (2 if distributed else 1)
    torch.manual_seed(0)
    model = factory()
    data = _dataset(shape, batch * (steps + WARMUP + 1) * accelerator.num_processes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(data, batch_size=batch, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    return _timed_loop(model, optimizer, loader, steps, accelerator.backward, accelerator.wait_for_everyone)


def _in_fresh_process(fn: Callable[[str, bool], float], workload: str, distributed: bool) -> float:
    if distributed:
        return run_on_ranks(fn, world_size=2, args=(workload, True), timeout=600)[0]
    return run_on_ranks(_single, world_size=1, args=(fn, workload), timeout=600)[0]


def _single(fn: Callable[[str, bool], float], workload: str) -> float:
    torch.set_num_threads(2)  # one process may use both cores
    return fn(workload, False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    parser.add_argument("--quick", action="store_true", help="one short repeat: checks the script works (not a measurement)")
    args = parser.parse_args()
    if args.quick:
        args.repeats = 1
    frameworks: dict[str, Callable[[str, bool], float]] = {"hand-written": run_plain, "hasten": run_hasten}
    try:
        import accelerate  # noqa: F401

        frameworks["accelerate"] = run_accelerate
    except ImportError:
        print("accelerate is not installed: `pip install accelerate` to include it")
    for workload in args.workloads:
        for distributed in (True, False):
            results: dict[str, list[float]] = {name: [] for name in frameworks}
            for _ in range(args.repeats):
                for name, fn in frameworks.items():  # interleaved, so drift hits everyone alike
                    results[name].append(_in_fresh_process(fn, workload, distributed))
            base = statistics.median(results["hand-written"])
            setting = "2 gloo ranks" if distributed else "1 process"
            print(f"\n{workload} ({setting}), steps/s, median of {args.repeats}:")
            for name, values in results.items():
                median = statistics.median(values)
                print(f"  {name:13s} {median:8.2f}  ({median / base:.3f}x hand-written)   runs: "
                      + ", ".join(f"{v:.1f}" for v in values))


if __name__ == "__main__":
    main()
