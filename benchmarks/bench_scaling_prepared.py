"""Per-step overhead vs the number of prepared objects: K models + K optimizers + K loaders, K = 1, 4, 16.

One process. Each step runs, for each of the K triples, one tiny-MLP training step (next batch, forward,
backward, optimizer step, zero_grad) with one torch thread, timed in process CPU time: the hand-written loop with raw objects, hasten's with the objects
``accelerator.prepare`` returned, and Accelerate's likewise (``cpu=True``). The wrappers' cost per
object must stay flat: hasten / hand-written should not move as K grows. Each measurement is a fresh
process; frameworks are interleaved; the median over --repeats is reported.

    python benchmarks/bench_scaling_prepared.py            # full: K = 1, 4, 16, 3 repeats
    python benchmarks/bench_scaling_prepared.py --quick    # smoke test
"""

from __future__ import annotations

import time
from typing import Any

import _scaling
import torch
import torch.nn.functional as F
from bench_training import _dataset, tiny_mlp
from torch.utils.data import DataLoader

from hasten.testing import run_on_ranks

BATCH, WARMUP = 32, 5


def _objects(k: int, steps: int) -> tuple[list[Any], list[Any], list[Any]]:
    torch.manual_seed(0)
    models = [tiny_mlp() for _ in range(k)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.01) for m in models]
    loaders = [DataLoader(_dataset((32,), BATCH * (steps + WARMUP)), batch_size=BATCH, shuffle=True)
               for _ in range(k)]
    return models, optimizers, loaders


def _run(framework: str, k: int, steps: int) -> float:
    """CPU seconds per outer step (K inner steps), measured in this (fresh) process.

    The process runs one torch thread and no collectives, so its CPU time is its wall time on an idle
    machine, and unlike wall time it does not count the time other programs held the cores. The figure
    is the median over chunks of steps (see ``_scaling.median_chunk_time``).
    """
    torch.set_num_threads(1)
    models, optimizers, loaders = _objects(k, steps)
    backward = lambda loss: loss.backward()  # noqa: E731
    if framework != "hand-written":
        if framework == "hasten":
            from hasten import Accelerator

            accelerator = Accelerator()
        else:
            from accelerate import Accelerator as HFAccelerator

            accelerator = HFAccelerator(cpu=True)
        prepared = accelerator.prepare(*models, *optimizers, *loaders)
        models, optimizers, loaders = prepared[:k], prepared[k:2 * k], prepared[2 * k:]
        backward = accelerator.backward
    iterators = [iter(loader) for loader in loaders]
    triples = list(zip(models, optimizers, iterators))

    def step() -> None:
        for model, optimizer, it in triples:
            x, y = next(it)
            backward(F.nll_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()

    for _ in range(WARMUP):
        step()
    return _scaling.median_chunk_time(step, steps, time.process_time)


def main() -> None:
    parser = _scaling.parser(__doc__.splitlines()[0])
    parser.add_argument("--counts", type=int, nargs="+", default=None)
    parser.add_argument("--steps", type=int, default=None, help="outer steps per run (default 3200/K, quick 800/K)")
    args = _scaling.finish_args(parser.parse_args())
    counts = args.counts or [1, 4, 16]
    frameworks = ["hand-written", "hasten"] + (["accelerate"] if _scaling.have_accelerate() else [])
    times: dict[str, dict[int, list[float]]] = {f: {k: [] for k in counts} for f in frameworks}
    for k in counts:
        steps = args.steps or max(20, (800 if args.quick else 3200) // k)
        for _ in range(args.repeats):
            for framework in frameworks:  # interleaved: drift hits every framework alike
                times[framework][k].append(run_on_ranks(_run, world_size=1, args=(framework, k, steps),
                                                        timeout=600)[0])
    med = {f: {k: _scaling.median(v) for k, v in per.items()} for f, per in times.items()}
    header = ["prepared models/optimizers/loaders (K)", "hand-written (µs/inner step)", "hasten (µs/inner step)",
              "hasten / hand-written"] + (["Accelerate (µs/inner step)", "Accelerate / hand-written"]
                                          if "accelerate" in med else [])
    rows, summary = [], []
    for k in counts:
        base = med["hand-written"][k]
        row = [k, f"{1e6 * base / k:.1f}", f"{1e6 * med['hasten'][k] / k:.1f}", f"{med['hasten'][k] / base:.3f}x"]
        if "accelerate" in med:
            row += [f"{1e6 * med['accelerate'][k] / k:.1f}", f"{med['accelerate'][k] / base:.3f}x"]
        rows.append(row)
        summary.append({"benchmark": "prepared objects", "point": f"K={k}", "metric": "step time / hand-written",
                        "hasten": med["hasten"][k] / base,
                        "accelerate": med["accelerate"][k] / base if "accelerate" in med else None,
                        "target": "flat in K"})
    spread = [med["hasten"][k] / med["hand-written"][k] for k in counts]
    notes = (f"Step time ratio (lower is better; 1.0 = hand-written). hasten's ratio moves by "
             f"{max(spread) - min(spread):+.3f} from K={counts[0]} to K={counts[-1]}: the target is flat.")
    _scaling.write_outputs(args, "prepared", "Per-step cost vs number of prepared objects (1 process, tiny MLP)",
                           header, rows, {"seconds_per_step": times}, summary, notes)
    _scaling.plot(args, "prepared", "Per-step cost vs number of prepared model/optimizer/loader triples",
                  "K (prepared triples)", "step time / hand-written",
                  {f: (counts, [med[f][k] / med["hand-written"][k] for k in counts]) for f in frameworks},
                  logx=True, hline=1.0,
                  second=("µs per inner step", {f: (counts, [1e6 * med[f][k] / k for k in counts])
                                                for f in frameworks}))


if __name__ == "__main__":
    main()
