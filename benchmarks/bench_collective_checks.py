"""Cost of the cross-rank shape/dtype check in ``gather`` / ``reduce`` (issue 16, "no silent wrong answer").

Two gloo ranks; per call, hasten's ``gather`` (fingerprint all-gather + data all-gather + cat, plus the
hang watchdog's bookkeeping) vs a plain
``torch.distributed.all_gather`` + ``torch.cat`` of the same tensor, and hasten's ``reduce(sum)`` vs a
plain ``all_reduce``, interleaved in the same run. Prints microseconds per call (median of rounds) and
the extra time the check adds.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_collective_checks.py --calls 300 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from hasten.testing import run_on_ranks

SIZES = {"scalar metric (1 float)": (1,), "eval batch preds (64x10)": (64, 10), "1M floats (4 MB)": (1_000_000,)}


def _per_call_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(10):
        fn()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    dist.barrier()
    return (time.perf_counter() - start) / calls * 1e6


def _plain_gather(t: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return torch.cat(parts)


def _plain_reduce(t: torch.Tensor) -> torch.Tensor:
    out = t.clone()
    dist.all_reduce(out)
    return out


def _body(calls: int, rounds: int) -> dict[str, dict[str, float]]:
    from hasten import PartialState
    from hasten.runtime.watchdog import TRACKER
    from hasten.utils import gather, reduce

    PartialState()  # as in a real run: the hang watchdog runs and every collective is tracked
    assert TRACKER.enabled
    results: dict[str, dict[str, list[float]]] = {}
    for label, shape in SIZES.items():
        t = torch.randn(shape)
        n = max(20, calls // 20) if t.numel() > 100_000 else calls
        row = results.setdefault(label, {"torch all_gather": [], "hasten gather": [], "torch all_reduce": [],
                                         "hasten reduce": []})
        for _ in range(rounds):  # interleaved so that load on the machine hits both sides alike
            row["torch all_gather"].append(_per_call_us(lambda: _plain_gather(t), n))
            row["hasten gather"].append(_per_call_us(lambda: gather(t), n))
            row["torch all_reduce"].append(_per_call_us(lambda: _plain_reduce(t), n))
            row["hasten reduce"].append(_per_call_us(lambda: reduce(t, reduction="sum"), n))
    return {label: {k: statistics.median(v) for k, v in row.items()} for label, row in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    result = run_on_ranks(_body, world_size=2, args=(args.calls, args.rounds), timeout=1800)[0]
    print(f"{'payload':28} {'torch gather':>13} {'hasten gather':>14} {'extra':>8}   "
          f"{'torch reduce':>13} {'hasten reduce':>14} {'extra':>8}   (microseconds per call, 2 gloo ranks)")
    for label, row in result.items():
        g0, g1, r0, r1 = (row["torch all_gather"], row["hasten gather"], row["torch all_reduce"],
                          row["hasten reduce"])
        print(f"{label:28} {g0:13.1f} {g1:14.1f} {g1 - g0:+8.1f}   {r0:13.1f} {r1:14.1f} {r1 - r0:+8.1f}")


if __name__ == "__main__":
    main()
