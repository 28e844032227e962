"""save_state / load_state time and bytes vs model size, full (1 process) and sharded (FSDP2 + DCP, 2 ranks).

The model is a stack of ``nn.Linear(W, W)`` (float32) sized to the point, trained one AdamW step so the
optimizer holds its two moments: the checkpoint is model + optimizer state (3x the model's bytes).

  * full, 1 process: hasten and Accelerate ``save_state``/``load_state`` (safetensors model files, their
    default) against the floor, which writes the same tensors itself: ``torch.save`` of both state
    dicts in one file, and safetensors ``save_file`` for the model + ``torch.save`` for the optimizer
    (the ratios' floor). That floor, like Accelerate, never fsyncs: its save ends with the bytes in the
    page cache. hasten's save is durable (fsync of every file and folder before publication, CRC-32
    manifest), so "safetensors+fsync" (the same floor plus one fsync per file and of the folder) is
    shown beside it as the floor of a durable save;
  * sharded, 2 gloo ranks: hasten with FSDP2 (``SHARDED_STATE_DICT``: torch.distributed.checkpoint)
    against the floor written by hand (``fully_shard`` per layer, ``get_state_dict`` + ``dcp.save``;
    ``dcp.load`` + ``set_state_dict``). Accelerate's FSDP does not run on CPU (with ``cpu=True`` it
    ignores the plugin), so it has no sharded row.

Times are the slowest rank's; "bytes" is what the checkpoint folder holds. Each point is a fresh set of
processes writing into a fresh folder; every case first does one untimed save + load (one-time lazy
imports and allocations, which made the first case look slow), then ``os.sync()``, then the timed
round. Reads come from the page cache. Cases are interleaved; medians over --repeats.

    python benchmarks/bench_scaling_checkpoint.py            # full: model 0.1-0.8 GB, 3 repeats (~5 GB of disk)
    python benchmarks/bench_scaling_checkpoint.py --quick    # 12-50 MB, one repeat
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import _scaling
import torch
from torch import nn

from hasten.testing import run_on_ranks

WIDTH = 1024  # 4.2 MB per layer


def _model(layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(layers)))


def _one_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(4, WIDTH)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _folder_bytes(folder: str) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def _timed(save: Any, load: Any, folder: str, barrier: Any = lambda: None) -> dict[str, float]:
    """Time ``save(folder)`` then ``load(folder)``, after one untimed round into a scratch folder.

    The untimed round pays each case's one-time costs (lazy imports inside torch.save/torch.load and
    safetensors, first allocations) so that every case, the floor included, is measured warm; it is
    removed and the dirty pages flushed (``os.sync``) before the timed round, so no case inherits the
    writeback of another's files.
    """
    warm = folder.rstrip("/") + "-warm"
    os.makedirs(warm, exist_ok=True)
    save(warm)
    barrier()
    load(warm)
    barrier()
    shutil.rmtree(warm, ignore_errors=True)
    os.makedirs(folder, exist_ok=True)
    os.sync()
    barrier()
    start = time.perf_counter()
    save(folder)
    barrier()
    save_s = time.perf_counter() - start
    start = time.perf_counter()
    load(folder)
    barrier()
    return {"save_s": save_s, "load_s": time.perf_counter() - start, "bytes": _folder_bytes(folder)}


def _full(case: str, layers: int, folder: str) -> dict[str, float]:
    torch.set_num_threads(1)
    model = _model(layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if case == "torch.save":
        def save(where: str) -> None:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, f"{where}/state.pt")

        def load(where: str) -> None:
            state = torch.load(f"{where}/state.pt", weights_only=True)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        _one_step(model, optimizer)
        return _timed(save, load, folder)
    if case in ("safetensors", "safetensors+fsync"):
        from safetensors.torch import load_file, save_file

        def save(where: str) -> None:
            save_file(model.state_dict(), os.path.join(where, "model.safetensors"))
            torch.save(optimizer.state_dict(), os.path.join(where, "optimizer.pt"))
            if case == "safetensors+fsync":  # what a durable save cannot skip: data and entries on disk
                for name in ("model.safetensors", "optimizer.pt", ""):
                    fd = os.open(os.path.join(where, name), os.O_RDONLY)
                    os.fsync(fd)
                    os.close(fd)

        def load(where: str) -> None:
            model.load_state_dict(load_file(os.path.join(where, "model.safetensors")))
            optimizer.load_state_dict(torch.load(os.path.join(where, "optimizer.pt"), weights_only=True))
        _one_step(model, optimizer)
        return _timed(save, load, folder)
    if case == "hasten":
        from hasten import Accelerator

        accelerator = Accelerator()
    else:
        from accelerate import Accelerator as HFAccelerator

        accelerator = HFAccelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    _one_step(model, optimizer)
    return _timed(accelerator.save_state, accelerator.load_state, folder)


def _sharded(case: str, layers: int, folder: str) -> dict[str, float]:
    import torch.distributed as dist

    model = _model(layers)
    if case == "dcp by hand":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        _one_step(model, optimizer)

        def save(where: str) -> None:
            model_state, optim_state = get_state_dict(model, optimizer)
            dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=where)

        def load(where: str) -> None:
            model_state, optim_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optimizer": optim_state}
            dcp.load(state, checkpoint_id=where)
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        return _timed(save, load, folder, dist.barrier)
    from hasten import Accelerator
    from hasten.config.plugins.fsdp import FullyShardedDataParallelPlugin

    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Linear"]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    _one_step(model, optimizer)
    return _timed(accelerator.save_state, accelerator.load_state, folder, dist.barrier)


def main() -> None:
    parser = _scaling.parser(__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=None, help="model sizes, in 4.2 MB layers")
    args = _scaling.finish_args(parser.parse_args())
    layer_counts = args.layers or ([3, 6, 12] if args.quick else [24, 48, 96, 192])
    full_cases = ["torch.save", "safetensors", "safetensors+fsync", "hasten"] + (["accelerate"] if _scaling.have_accelerate() else [])
    sharded_cases = ["dcp by hand", "hasten fsdp2"]
    runs: dict[str, dict[int, list[dict[str, float]]]] = {
        c: {n: [] for n in layer_counts} for c in full_cases + sharded_cases}
    root = Path(tempfile.mkdtemp(prefix="bench-ckpt-scaling-"))
    try:
        for layers in layer_counts:
            for _ in range(args.repeats):
                for case in full_cases + sharded_cases:  # interleaved
                    folder = str(root / f"{case.replace(' ', '_')}-{layers}")
                    if case in full_cases:
                        result = run_on_ranks(_full, world_size=1, args=(case, layers, folder), timeout=600)
                    else:
                        result = run_on_ranks(_sharded, world_size=2, args=(case, layers, folder), timeout=600)
                    runs[case][layers].append({"save_s": max(r["save_s"] for r in result),
                                               "load_s": max(r["load_s"] for r in result),
                                               "bytes": result[0]["bytes"]})
                    shutil.rmtree(folder, ignore_errors=True)
            print(f"{layers} layers done", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {c: {n: {k: _scaling.median([r[k] for r in per[n]]) for k in ("save_s", "load_s", "bytes")}
               for n in layer_counts} for c, per in runs.items()}
    sizes = {n: n * (WIDTH + 1) * WIDTH * 4 / 1e9 for n in layer_counts}
    header = ["model (GB)", "setting"] + ["case: save s / load s / MB written", "save / floor", "load / floor"]
    rows, summary = [], []
    for n in layer_counts:
        for setting, cases, floor in (("full, 1 process", full_cases, "safetensors"),
                                      ("sharded, 2 ranks", sharded_cases, "dcp by hand")):
            f = med[floor][n]
            for case in cases:
                m = med[case][n]
                rows.append([f"{sizes[n]:.2f}", setting,
                             f"{case}: {m['save_s']:.3f} / {m['load_s']:.3f} / {m['bytes'] / 1e6:.0f}",
                             f"{m['save_s'] / f['save_s']:.2f}x", f"{m['load_s'] / f['load_s']:.2f}x"])
            ours = med["hasten" if floor == "safetensors" else "hasten fsdp2"][n]
            acc = med.get("accelerate", {}).get(n) if floor == "safetensors" else None
            for what in ("save_s", "load_s"):
                summary.append({"benchmark": f"checkpoint ({setting.split(',')[0]})", "point": f"{sizes[n]:.2f} GB",
                                "metric": f"{what[:-2]} / {floor}", "hasten": ours[what] / f[what],
                                "accelerate": acc[what] / f[what] if acc else None, "target": "near 1"})
    notes = ("Model + AdamW state (3x the model). Ratios are to safetensors+torch.save (full) and to DCP written by "
             "hand (sharded); lower is better.")
    _scaling.write_outputs(args, "checkpoint", "save_state / load_state vs model size", header, rows,
                           {"runs": runs, "model_gb": sizes}, summary, notes)
    xs = [sizes[n] for n in layer_counts]
    _scaling.plot(args, "checkpoint", "save_state / load_state vs model size", "model size (GB)", "save (s)",
                  {c: (xs, [med[c][n]["save_s"] for n in layer_counts]) for c in runs},
                  second=("load (s)", {c: (xs, [med[c][n]["load_s"] for n in layer_counts]) for c in runs}))


if __name__ == "__main__":
    main()
