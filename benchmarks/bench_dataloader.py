"""Prepared DataLoader throughput with no per-batch work: hasten vs raw DataLoader+DistributedSampler vs Accelerate.

2 gloo ranks (forked by ``hasten.testing.run_on_ranks``), a TensorDataset of small samples (so the
loader's own overhead is what is measured), shuffled and unshuffled. Each repeat is a fresh pair of
ranks in which the variants alternate epoch by epoch (load bursts on a shared machine hit them alike):
one warm-up epoch each, then ``--epochs`` timed epochs each, between barriers. Reported: median
batches/s per rank over ``--repeats`` (each the median of its epochs), the ratio to raw, and the median
of the per-epoch ratios to the raw epoch of the same round. Accelerate is included when installed (``Accelerator(cpu=True)``, which it needs under
a CPU-only process group).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_dataloader.py --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from hasten.testing import run_on_ranks


def _dataset(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 10, (n,), generator=g))


def _raw(data: TensorDataset, batch: int, shuffle: bool) -> tuple[Iterable[Any], Callable[[int], None]]:
    sampler = DistributedSampler(data, shuffle=shuffle, seed=0)
    return DataLoader(data, batch_size=batch, sampler=sampler), sampler.set_epoch


def _hasten(data: TensorDataset, batch: int, shuffle: bool) -> tuple[Iterable[Any], Callable[[int], None]]:
    from hasten import Accelerator

    loader = Accelerator().prepare(DataLoader(data, batch_size=batch, shuffle=shuffle))
    return loader, lambda epoch: None


def _accelerate(data: TensorDataset, batch: int, shuffle: bool) -> tuple[Iterable[Any], Callable[[int], None]]:
    from accelerate import Accelerator as HFAccelerator

    accelerator = HFAccelerator(cpu=True)
    assert accelerator.num_processes == dist.get_world_size()
    loader = accelerator.prepare(DataLoader(data, batch_size=batch, shuffle=shuffle))
    return loader, lambda epoch: None


VARIANTS = {"raw": _raw, "hasten": _hasten, "accelerate": _accelerate}


def _epoch_rate(loader: Iterable[Any], set_epoch: Callable[[int], None], epoch: int) -> float:
    set_epoch(epoch)
    dist.barrier()
    count = 0
    start = time.perf_counter()
    for _ in loader:
        count += 1
    elapsed = time.perf_counter() - start
    dist.barrier()
    return count / elapsed


def _one_repeat(names: list[str], samples: int, batch: int, epochs: int, shuffle: bool) -> dict[str, list[float]]:
    """Per variant, the rate of each timed epoch; variants alternate epoch by epoch (bursts of load on a
    shared machine then hit them alike), after one warm-up epoch each."""
    data = _dataset(samples)
    loaders = {name: VARIANTS[name](data, batch, shuffle) for name in names}
    for loader, set_epoch in loaders.values():
        _epoch_rate(loader, set_epoch, 0)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for epoch in range(1, epochs + 1):
        order = names[epoch % len(names):] + names[:epoch % len(names)]
        for name in order:
            rates[name].append(_epoch_rate(*loaders[name], epoch))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rates)
    # The slower rank sets the pace of each epoch.
    return {name: [min(rank[name][e] for rank in gathered) for e in range(epochs)] for name in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--samples", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=9)
    parser.add_argument("--quick", action="store_true", help="one short repeat: checks the script works (not a measurement)")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.samples, args.epochs = 1, 4096, 3
    names = ["raw", "hasten"]
    try:
        import accelerate

        names.append("accelerate")
        print(f"accelerate {accelerate.__version__}, torch {torch.__version__}")
    except ImportError:
        print("accelerate is not installed: `pip install accelerate` to include it")
    for shuffle in (True, False):
        runs: dict[str, list[float]] = {name: [] for name in names}
        ratios: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(args.repeats):
            rates = run_on_ranks(_one_repeat, world_size=2, timeout=600,
                                 args=(names, args.samples, args.batch, args.epochs, shuffle))[0]
            for name in names:
                runs[name].append(statistics.median(rates[name]))
                ratios[name] += [r / b for r, b in zip(rates[name], rates["raw"])]  # same-round pairs
        base = statistics.median(runs["raw"])
        label = "shuffled" if shuffle else "unshuffled"
        print(f"\n{label}: {args.samples} samples, batch {args.batch}/rank, 2 gloo ranks; batches/s per rank "
              f"(median of {args.repeats} runs, each the median of {args.epochs} alternating epochs):")
        for name in names:
            median = statistics.median(runs[name])
            ratio = statistics.median(ratios[name])
            print(f"  {name:11s} {median:9.0f}  {median / base:.3f}x raw (paired epochs: {ratio:.3f}x, "
                  f"{(1 / median - 1 / base) * 1e6:+.1f} us/batch)   runs: " + ", ".join(f"{v:.0f}" for v in runs[name]))


if __name__ == "__main__":
    main()
