"""How long an asynchronous save blocks the training loop, and how much it slows the steps that overlap it.

The model is a stack of ``nn.Linear(W, W)`` (float32) sized to the point, trained with AdamW so the
checkpoint is model + optimizer state (3x the model's bytes), on 1 process (full state). A "step" is
forward + backward + ``optimizer.step()`` on a batch of 4: AdamW's pass over the state dominates it,
which makes it memory-bound like the background save it competes with.

Cases, each in a fresh process, interleaved, medians over --repeats:

  * ``hasten sync``: ``save_state(folder)``; blocks until the checkpoint is durable and published;
  * ``hasten async``: ``save_state(folder, async_save=True)``; blocks until the state is serialised in
    host memory, then steps run while the background writes, fsyncs and publishes;
  * ``dcp sync`` / ``dcp async``: torch.distributed.checkpoint by hand (``get_state_dict`` then
    ``dcp.save`` / ``dcp.async_save``, which stages a copy in host memory and writes in a thread);
    DCP does not fsync;
  * ``accelerate sync``: Accelerate's ``save_state`` (no asynchronous save exists; no fsync).

Per case: the normal step time (median of steps before the save), the time the loop is blocked by the
save call, the time until the save is complete (durable and published, or the Future done), and the
median time of the steps taken while the save runs in the background. Every case first does one
untimed save (one-time costs), then ``os.sync()``.

    python benchmarks/bench_scaling_async_checkpoint.py            # full: model 0.1-0.8 GB (~8 GB of disk at most)
    python benchmarks/bench_scaling_async_checkpoint.py --quick    # 12-50 MB, one repeat
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _scaling
import torch
from torch import nn

from hasten.testing import run_on_ranks

WIDTH = 1024  # 4.2 MB per layer
NORMAL_STEPS = 6


def _model(layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(layers)))


def _saver(case: str, model: nn.Module, optimizer: torch.optim.Optimizer
           ) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[str], Callable[[], bool] | None]]:
    """``(model, optimizer, save)``: ``save(folder)`` returns None (done) or a "still running?" callable."""
    if case.startswith("dcp"):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        def dcp_save(where: str) -> Callable[[], bool] | None:
            model_state, optim_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optimizer": optim_state}
            if case == "dcp sync":
                dcp.save(state, checkpoint_id=where)
                return None
            future = dcp.async_save(state, checkpoint_id=where)
            future = getattr(future, "upload_completion", future)  # AsyncSaveResponse in newer torch
            return lambda: not future.done()
        return model, optimizer, dcp_save
    if case.startswith("hasten"):
        from hasten import Accelerator

        accelerator = Accelerator()
    else:
        from accelerate import Accelerator as HFAccelerator

        accelerator = HFAccelerator(cpu=next(model.parameters()).device.type == "cpu")
    model, optimizer = accelerator.prepare(model, optimizer)

    print(f"{case}: training on {next(model.parameters()).device}", flush=True)

    def save(where: str) -> Callable[[], bool] | None:
        if case != "hasten async":
            accelerator.save_state(where)
            return None
        accelerator.save_state(where, async_save=True)
        saver = accelerator._background_saver  # no public "is it done?": wait_for_checkpoint() blocks
        return lambda: saver is not None and saver.in_flight
    return model, optimizer, save


def _case(case: str, layers: int, folder: str, device: str = "cpu") -> dict[str, Any]:
    torch.set_num_threads(1)
    raw = _model(layers).to(device)
    model, optimizer, save = _saver(case, raw, torch.optim.AdamW(raw.parameters(), lr=1e-3))
    batch = torch.randn(4, WIDTH, device=device)
    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def step() -> float:
        start = time.perf_counter()
        model(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        synchronize()  # a step's time is the GPU's, not the launch of its kernels
        return time.perf_counter() - start

    step()
    warm = folder.rstrip("/") + "-warm"
    running = save(warm)  # one untimed save: lazy imports, first allocations, the side process group
    while running is not None and running():
        step()
    if case == "dcp async":  # the Future can be done a moment before its thread lets go of the files
        time.sleep(0.1)
    if case == "hasten async":
        from hasten.state import PartialState  # noqa: F401  (the accelerator waits on its own below)
    shutil.rmtree(warm, ignore_errors=True)
    normal = [step() for _ in range(NORMAL_STEPS)]
    os.sync()
    start = time.perf_counter()
    running = save(folder)
    blocked = time.perf_counter() - start
    during = []
    while running is not None and running():
        during.append(step())
    total = time.perf_counter() - start
    return {"normal_s": statistics.median(normal), "blocked_s": blocked, "total_s": total, "during": during}


def main() -> None:
    parser = _scaling.parser(__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=None, help="model sizes, in 4.2 MB layers")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the model trains (cuda: the snapshot copies to pinned host buffers)")
    args = _scaling.finish_args(parser.parse_args())
    layer_counts = args.layers or ([3, 6, 12] if args.quick else [24, 48, 96, 192])
    cases = ["hasten sync", "hasten async", "dcp sync", "dcp async"] + (
        ["accelerate sync"] if _scaling.have_accelerate() else [])
    # the harness's ranks are CPU ranks unless told otherwise (this process has not touched CUDA)
    gpu_env = {"ACCELERATE_USE_CPU": "false"} if args.device == "cuda" else {}
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {c: {n: [] for n in layer_counts} for c in cases}
    root = Path(tempfile.mkdtemp(prefix="bench-async-ckpt-"))
    try:
        for layers in layer_counts:
            for _ in range(args.repeats):
                for case in cases:  # interleaved
                    folder = str(root / f"{case.replace(' ', '_')}-{layers}")
                    runs[case][layers].append(run_on_ranks(_case, world_size=1, timeout=900, env=gpu_env,
                                                           args=(case, layers, folder, args.device))[0])
                    shutil.rmtree(folder, ignore_errors=True)
            print(f"{layers} layers done (load average {os.getloadavg()[0]:.1f})", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    _report(args, layer_counts, cases, runs)


def _medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    med = {k: _scaling.median([r[k] for r in runs]) for k in ("normal_s", "blocked_s", "total_s")}
    # steps during the save: pooled over the repeats (a save that ends within a step gives one or none)
    during = [s for r in runs for s in r["during"]]
    med["during_s"] = _scaling.median(during)
    med["during_n"] = len(during) / len(runs)
    return med


def _report(args: Any, layer_counts: list[int], cases: list[str], runs: dict[str, dict[int, list[dict[str, Any]]]]
            ) -> None:
    med = {c: {n: _medians(runs[c][n]) for n in layer_counts} for c in cases}
    sizes = {n: n * (WIDTH + 1) * WIDTH * 4 / 1e9 for n in layer_counts}
    header = ["model (GB)", "case", "blocked s", "blocked / own sync save", "done after s", "normal step s",
              "step during save s (steps)", "during / normal"]
    rows, summary = [], []
    for n in layer_counts:
        for case in cases:
            m = med[case][n]
            sync = med[case.replace("async", "sync")][n]["blocked_s"]
            during = f"{m['during_s']:.3f} ({m['during_n']:.1f})" if m["during_n"] else "-"
            slow = f"{m['during_s'] / m['normal_s']:.2f}x" if m["during_n"] else "-"
            rows.append([f"{sizes[n]:.2f}", case, f"{m['blocked_s']:.3f}", f"{m['blocked_s'] / sync:.2f}x",
                         f"{m['total_s']:.3f}", f"{m['normal_s']:.3f}", during, slow])
        ours = med["hasten async"][n]
        point = f"{sizes[n]:.2f} GB"
        summary.append({"benchmark": "async checkpoint", "point": point, "metric": "blocked / hasten sync save",
                        "hasten": ours["blocked_s"] / med["hasten sync"][n]["blocked_s"], "accelerate": None,
                        "target": "<= 0.10 at 0.8 GB"})
        summary.append({"benchmark": "async checkpoint", "point": point,
                        "metric": "step during save / normal step",
                        "hasten": ours["during_s"] / ours["normal_s"] if ours["during_n"] else None,
                        "accelerate": None, "target": "<= 1.3"})
    notes = ("Model + AdamW state (3x the model), 1 process. \"blocked\": seconds the save call holds the loop; "
             "\"done after\": seconds from the call until the checkpoint is complete (hasten: durable and "
             "published; DCP: its Future done, no fsync). Steps during the save: the median of the steps taken "
             "while it runs in the background, and how many per save. Accelerate has no asynchronous save.")
    _scaling.write_outputs(args, "async_checkpoint", "asynchronous save: blocked time and overlapping steps",
                           header, rows, {"runs": runs, "model_gb": sizes, "load_average": os.getloadavg()},
                           summary, notes)
    xs = [sizes[n] for n in layer_counts]
    _scaling.plot(args, "async_checkpoint", "asynchronous save: blocked time and overlapping steps",
                  "model size (GB)", "loop blocked by the save (s)",
                  {c: (xs, [med[c][n]["blocked_s"] for n in layer_counts]) for c in cases},
                  second=("step during save / normal step",
                          {c: (xs, [med[c][n]["during_s"] / med[c][n]["normal_s"] for n in layer_counts])
                           for c in cases if "async" in c}),
                  hline=None)


if __name__ == "__main__":
    main()
