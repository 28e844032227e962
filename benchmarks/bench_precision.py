"""Step-time overhead of hasten's mixed precision and gradient accumulation vs the hand-written loops.

- bf16: `Accelerator(mixed_precision="bf16")` vs a hand-written `torch.autocast("cpu", torch.bfloat16)`
  loop, one process (same model, data and optimizer); Accelerate with cpu=True alongside when installed.
- accumulation: `Accelerator(gradient_accumulation_steps=4)` + `accumulate()` vs hand-written DDP with
  `no_sync()` on three of every four micro-steps, 2 gloo ranks.

Target: hasten <= 1.01x the hand-written step time. Medians of --repeats fresh runs, interleaved.

    .venv/bin/python benchmarks/bench_precision.py --repeats 5
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hasten.testing import run_on_ranks

STEPS, WARMUP, BATCH = 120, 10, 64


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 256, generator=g), torch.randint(0, 10, (BATCH,), generator=g)) for _ in range(n)]


def _time(step: Callable[[torch.Tensor, torch.Tensor], None], batches: list, barrier: Callable[[], None]) -> float:
    for x, y in batches[:WARMUP]:
        step(x, y)
    barrier()
    start = time.perf_counter()
    for x, y in batches[WARMUP:]:
        step(x, y)
    barrier()
    return (time.perf_counter() - start) / (len(batches) - WARMUP) * 1e3  # ms per micro-step


def bf16_hand_written() -> float:
    model, batches = _model(), _batches(STEPS + WARMUP)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        F.cross_entropy(out.float(), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    return _time(step, batches, lambda: None)


def _bf16_with(accelerator_cls: type, **kwargs: object) -> float:
    accelerator = accelerator_cls(mixed_precision="bf16", **kwargs)
    model, batches = _model(), _batches(STEPS + WARMUP)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        accelerator.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()

    return _time(step, batches, lambda: None)


def bf16_hasten() -> float:
    from hasten import Accelerator

    return _bf16_with(Accelerator)


def bf16_accelerate() -> float:
    from accelerate import Accelerator

    return _bf16_with(Accelerator, cpu=True)


def accumulation_hand_written() -> float:
    model = nn.parallel.DistributedDataParallel(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = _batches(STEPS + WARMUP)
    counter = [0]

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        counter[0] += 1
        sync = counter[0] % 4 == 0
        with contextlib.nullcontext() if sync else model.no_sync():
            (F.cross_entropy(model(x), y) / 4).backward()
        if sync:
            optimizer.step()
            optimizer.zero_grad()

    return _time(step, batches, torch.distributed.barrier)


def _accumulation_with(accelerator_cls: type, **kwargs: object) -> float:
    accelerator = accelerator_cls(gradient_accumulation_steps=4, **kwargs)
    model, batches = _model(), _batches(STEPS + WARMUP)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with accelerator.accumulate(model):
            accelerator.backward(F.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()

    return _time(step, batches, accelerator.wait_for_everyone)


def accumulation_hasten() -> float:
    from hasten import Accelerator

    return _accumulation_with(Accelerator)


def accumulation_accelerate() -> float:
    from accelerate import Accelerator

    return _accumulation_with(Accelerator, cpu=True)


def _single(fn: Callable[[], float]) -> float:
    torch.set_num_threads(2)
    return fn()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="one short repeat: checks the script works (not a measurement)")
    args = parser.parse_args()
    if args.quick:
        args.repeats = 1
    try:
        import accelerate  # noqa: F401
        have_accelerate = True
    except ImportError:
        have_accelerate = False
    cases = {
        "bf16, 1 process": ({"hand-written": bf16_hand_written, "hasten": bf16_hasten,
                             **({"accelerate": bf16_accelerate} if have_accelerate else {})}, 1),
        "accumulation N=4, 2 gloo ranks": ({"hand-written": accumulation_hand_written, "hasten": accumulation_hasten,
                                            **({"accelerate": accumulation_accelerate} if have_accelerate else {})}, 2),
    }
    for title, (frameworks, world) in cases.items():
        results: dict[str, list[float]] = {name: [] for name in frameworks}
        for _ in range(args.repeats):
            for name, fn in frameworks.items():
                if world == 1:
                    results[name].append(run_on_ranks(_single, world_size=1, args=(fn,), timeout=600)[0])
                else:
                    results[name].append(run_on_ranks(fn, world_size=world, timeout=600)[0])
        base = statistics.median(results["hand-written"])
        print(f"\n{title}: ms per micro-step, median of {args.repeats}")
        for name, values in results.items():
            median = statistics.median(values)
            print(f"  {name:13s} {median:7.3f} ms  ({median / base:.3f}x hand-written)   runs: "
                  + ", ".join(f"{v:.2f}" for v in values))


if __name__ == "__main__":
    main()
