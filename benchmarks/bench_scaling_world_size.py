"""Per-step overhead vs world size: hasten and Accelerate against hand-written DDP at 1, 2, 4, 8 processes.

The workload is bench_training's tiny MLP (batch 32 per process), where per-step overhead dominates; the
hand-written loop is plain PyTorch at 1 process and DDP + DistributedSampler above. Processes are forked
gloo ranks on this machine, one torch thread each: with more ranks than cores the CPU is oversubscribed,
so absolute speed falls with the world size and only the ratio to hand-written DDP at each size means
anything. Each run's figure is the slowest rank's median over 10 chunks of its steps (a burst of other
work spoils a chunk, not the run). Each point is a fresh set of ranks; frameworks are interleaved;
medians over --repeats.

    python benchmarks/bench_scaling_world_size.py            # full: 1, 2, 4, 8 processes, 3 repeats
    python benchmarks/bench_scaling_world_size.py --quick    # smoke test
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import _scaling
import torch
import torch.nn.functional as F
from bench_training import _dataset, tiny_mlp
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from hasten.testing import run_on_ranks

BATCH, WARMUP = 32, 5


def _loop(model: nn.Module, optimizer: Any, loader: Any, steps: int, backward: Callable[[Any], None],
          barrier: Callable[[], None]) -> float:
    it = iter(loader)

    def step() -> None:
        x, y = next(it)
        backward(F.nll_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(WARMUP):
        step()
    barrier()
    per_step = _scaling.median_chunk_time(step, steps, time.perf_counter)
    barrier()
    return per_step


def _run(framework: str, steps: int) -> float:
    """Seconds per step on this rank (every rank of the run returns one)."""
    world = torch.distributed.get_world_size()  # run_on_ranks made the gloo group (a FileStore, no ports)
    torch.manual_seed(0)
    model = tiny_mlp()
    data = _dataset((32,), BATCH * (steps + WARMUP) * world)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if framework == "hand-written":
        if world > 1:
            model = nn.parallel.DistributedDataParallel(model)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            loader = DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, shuffle=True, seed=0))
            return _loop(model, optimizer, loader, steps, lambda loss: loss.backward(), torch.distributed.barrier)
        loader = DataLoader(data, batch_size=BATCH, shuffle=True)
        return _loop(model, optimizer, loader, steps, lambda loss: loss.backward(), lambda: None)
    if framework == "hasten":
        from hasten import Accelerator

        accelerator = Accelerator()
    else:
        from accelerate import Accelerator as HFAccelerator

        accelerator = HFAccelerator(cpu=True)  # without cpu=True each rank trains alone on a CPU-only machine
    assert accelerator.num_processes == world, (framework, accelerator.num_processes, world)
    loader = DataLoader(data, batch_size=BATCH, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    return _loop(model, optimizer, loader, steps, accelerator.backward, accelerator.wait_for_everyone)


def main() -> None:
    parser = _scaling.parser(__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=None)
    parser.add_argument("--steps", type=int, default=None, help="measured steps per run (default 300, quick 60)")
    args = _scaling.finish_args(parser.parse_args())
    sizes = args.sizes or [1, 2, 4, 8]
    steps = args.steps or (60 if args.quick else 300)
    frameworks = ["hand-written", "hasten"] + (["accelerate"] if _scaling.have_accelerate() else [])
    times: dict[str, dict[int, list[float]]] = {f: {n: [] for n in sizes} for f in frameworks}
    for n in sizes:
        for _ in range(args.repeats):
            for framework in frameworks:  # interleaved: drift hits every framework alike
                per_rank = run_on_ranks(_run, world_size=n, args=(framework, steps), timeout=600)
                times[framework][n].append(max(per_rank))  # the slowest rank sets the pace
    med = {f: {n: _scaling.median(v) for n, v in per.items()} for f, per in times.items()}
    header = ["processes", "hand-written (ms/step)", "hasten (ms/step)", "hasten / hand-written"] + (
        ["Accelerate (ms/step)", "Accelerate / hand-written"] if "accelerate" in med else [])
    rows, summary = [], []
    for n in sizes:
        base = med["hand-written"][n]
        row = [n, f"{1e3 * base:.3f}", f"{1e3 * med['hasten'][n]:.3f}", f"{med['hasten'][n] / base:.3f}x"]
        if "accelerate" in med:
            row += [f"{1e3 * med['accelerate'][n]:.3f}", f"{med['accelerate'][n] / base:.3f}x"]
        rows.append(row)
        summary.append({"benchmark": "world size", "point": f"{n} proc", "metric": "step time / hand-written DDP",
                        "hasten": med["hasten"][n] / base,
                        "accelerate": med["accelerate"][n] / base if "accelerate" in med else None,
                        "target": "<= 1.01"})
    notes = ("Step time ratio to the hand-written loop at the same size (lower is better). 1 process: plain "
             "PyTorch; more: DDP + DistributedSampler on gloo. Ranks beyond the core count share cores.")
    _scaling.write_outputs(args, "world_size", "Per-step time vs world size (tiny MLP, gloo, 1 thread per rank)",
                           header, rows, {"seconds_per_step": times, "steps": steps}, summary, notes)
    _scaling.plot(args, "world_size", "Per-step time vs world size (tiny MLP on gloo)", "processes",
                  "step time / hand-written", {f: (sizes, [med[f][n] / med["hand-written"][n] for n in sizes])
                                              for f in frameworks}, logx=True, hline=1.0,
                  second=("ms per step", {f: (sizes, [1e3 * med[f][n] for n in sizes]) for f in frameworks}))


if __name__ == "__main__":
    main()
