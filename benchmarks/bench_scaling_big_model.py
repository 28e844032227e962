"""Big-model load time and peak RSS vs model size: ``device_map="auto"``, a CPU budget (disk offload), the floor.

The model of bench_big_model.py (a stack of ``nn.Linear(W, W)``, float32, safetensors shards of 6 layers)
at 0.4 / 0.8 / 1.6 / 3.2 GB (W = 4096; 6 to 48 layers). Cases, each in a fresh process with a warm page
cache (bench_big_model.py's child): the floor (meta build + memory-mapped ``load_file`` +
``load_state_dict(assign=True)``), hasten and Accelerate ``load_checkpoint_and_dispatch(device_map="auto")``,
and both with ``max_memory={"cpu": 3/8 of the model}`` plus an offload folder ("disk"). Reported: load
time, load + first forward (a lazy load pays its page-in there), and the peak RSS through the first
forward. Targets: linear in bytes, hasten ``auto`` within 1.3x of the floor at every size.

    python benchmarks/bench_scaling_big_model.py            # full: 0.4-3.2 GB, 3 repeats (~10 GB of disk)
    python benchmarks/bench_scaling_big_model.py --quick    # 0.05-0.2 GB, one repeat
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import _scaling
import bench_big_model as big


def _fmt_mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.0f}"


def main() -> None:
    parser = _scaling.parser(__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=None, help="model sizes, in layers")
    parser.add_argument("--width", type=int, default=None)
    args = _scaling.finish_args(parser.parse_args())
    width = args.width or (2048 if args.quick else 4096)
    layer_counts = args.layers or ([3, 6, 12] if args.quick else [6, 12, 24, 48])
    cases = ["floor (mmap)", "hasten auto", "hasten disk"]
    if _scaling.have_accelerate():
        cases += ["accelerate auto", "accelerate disk"]
    results: dict[str, dict[float, list[dict[str, Any]]]] = {c: {} for c in cases}
    sizes: list[float] = []
    failures: dict[str, dict[float, str]] = {}
    root = Path(tempfile.mkdtemp(prefix="bench-big-scaling-"))
    try:
        for layers in layer_counts:
            gb = layers * (width + 1) * width * 4 / 1e9
            sizes.append(gb)
            big.configure(layers, width, f"{gb * 1e3 * 3 / 8:.0f}MB")
            folder = root / f"ckpt-{layers}"
            folder.mkdir()
            big.write_checkpoint(folder)
            for shard in folder.glob("*.safetensors"):  # warm the page cache
                with open(shard, "rb") as f:
                    while f.read(1 << 24):
                        pass
            for case in cases:
                results[case][gb] = []
            for _ in range(args.repeats):
                for case in cases:  # interleaved
                    try:
                        results[case][gb].append(big.run_case(case, folder))
                    except RuntimeError as exc:  # reported as a failed point, the other cases still run
                        failures.setdefault(case, {})[gb] = str(exc).strip().splitlines()[-1][:200]
                        print(f"{case} at {gb:.2f} GB failed: {failures[case][gb]}", flush=True)
            shutil.rmtree(folder, ignore_errors=True)
            print(f"{gb:.2f} GB done", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    nan = float("nan")
    med = {c: {gb: {k: _scaling.median([r[k] for r in runs]) if runs else nan
                    for k in ("load_s", "first_s", "peak", "first_peak")}
               for gb, runs in per.items()} for c, per in results.items()}
    header = ["model (GB)"] + [f"{c}: load s / load+fwd1 s / peak RSS MB" for c in cases] + \
        ["hasten auto / floor (load)", "hasten auto / floor (load+fwd1)"]
    rows, summary = [], []
    for gb in sizes:
        row: list[object] = [f"{gb:.2f}"]
        for c in cases:
            m = med[c][gb]
            row.append("failed" if gb in failures.get(c, {}) and not results[c][gb] else
                       f"{m['load_s']:.3f} / {m['first_s']:.3f} / {_fmt_mb(m['first_peak'])}")
        floor, auto = med["floor (mmap)"][gb], med["hasten auto"][gb]
        row += [f"{auto['load_s'] / floor['load_s']:.2f}x", f"{auto['first_s'] / floor['first_s']:.2f}x"]
        rows.append(row)
        acc = med.get("accelerate auto", {}).get(gb)
        summary.append({"benchmark": "big-model load", "point": f"{gb:.1f} GB", "metric": "auto load / floor",
                        "hasten": auto["load_s"] / floor["load_s"],
                        "accelerate": acc["load_s"] / floor["load_s"] if acc else None, "target": "<= 1.3"})
        summary.append({"benchmark": "big-model load", "point": f"{gb:.1f} GB",
                        "metric": "auto load+fwd1 / floor", "hasten": auto["first_s"] / floor["first_s"],
                        "accelerate": acc["first_s"] / floor["first_s"] if acc else None, "target": "<= 1.1"})
    failed = "; ".join(f"{c} at {gb:.2f} GB: {msg}" for c, per in failures.items() for gb, msg in per.items())
    notes = (f"Failed runs: {failed}. " if failed else "") + ("Peak RSS is VmHWM through the first forward (memory-mapped pages that the forward touches count). "
             "The disk cases get a CPU budget of 3/8 of the model.")
    _scaling.write_outputs(args, "big_model", "Big-model load vs model size (warm page cache, fresh process per case)",
                           header, rows, {"results": {c: {str(k): v for k, v in per.items()}
                                                      for c, per in results.items()}}, summary, notes)
    _scaling.plot(args, "big_model", "Big-model load vs model size", "model size (GB)", "load + first forward (s)",
                  {c: (sizes, [med[c][gb]["first_s"] for gb in sizes]) for c in cases},
                  second=("peak RSS through first forward (MB)",
                          {c: (sizes, [med[c][gb]["first_peak"] / 1e6 for gb in sizes]) for c in cases}))


if __name__ == "__main__":
    main()
