"""Big-model loading and disk-offloaded inference: hasten vs Accelerate vs the floor (issue 7's targets).

The model is 24 x ``nn.Linear(4096, 4096)`` (1.61 GB of float32), saved once as 4 safetensors shards with
an ``*.index.json`` in a temporary folder that is reused by every run and deleted at the end. Each case
runs in a fresh subprocess, so its peak RSS is its own:

  * floor: build on the meta device, then per shard ``safetensors.torch.load_file`` and
    ``load_state_dict(assign=True)`` (the least work a loader can do);
  * ``auto``: ``load_checkpoint_and_dispatch(model, folder, device_map="auto")`` (everything fits in RAM);
  * ``disk``: the same with ``max_memory={"cpu": "600MB"}`` and a fresh ``offload_folder``, so most
    layers are placed on "disk". The steady forward time is the median of forwards 2 to 6 (batch of 4 rows).

Load time covers the empty build and the load call. Peak RSS is the process's VmHWM after loading (the
high-water mark is reset through ``/proc/self/clear_refs`` just before the load; it includes the
interpreter and the imported libraries); "growth" is that peak minus the RSS before the load. The
forward's own peak is reported separately (mmap'd checkpoint pages that are touched count in RSS).
The checkpoint files are read once before the runs, so the page cache is warm: this measures the
loaders, not the disk. Cases are interleaved within each repeat; figures are medians over --repeats.

    .venv/bin/python benchmarks/bench_big_model.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

LAYERS, WIDTH, SHARDS, ROWS = 24, 4096, 4, 4
CPU_BUDGET = "600MB"
CASES = ("floor (mmap)", "floor (copy)", "hasten auto", "accelerate auto", "hasten disk", "accelerate disk")


def build() -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))


def configure(layers: int, width: int, cpu_budget: str) -> None:
    """Change the model (``bench_scaling_big_model.py`` runs this script's cases at several sizes)."""
    global LAYERS, WIDTH, SHARDS, CPU_BUDGET
    LAYERS, WIDTH, CPU_BUDGET = layers, width, cpu_budget
    SHARDS = max(1, -(-layers // 6))  # shards of up to 6 layers, as the default 24-layer model has


def write_checkpoint(folder: Path) -> None:
    """Shards of 6 layers, written layer by layer so the writer never holds the whole model."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    per_shard, weight_map = -(-LAYERS // SHARDS), {}
    for shard in range(SHARDS):
        name, tensors = f"model-{shard + 1:05d}-of-{SHARDS:05d}.safetensors", {}
        for i in range(shard * per_shard, min(LAYERS, (shard + 1) * per_shard)):
            layer = nn.Linear(WIDTH, WIDTH)
            tensors.update({f"{i}.weight": layer.weight.data, f"{i}.bias": layer.bias.data})
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    index = {"metadata": {"total_size": LAYERS * (WIDTH + 1) * WIDTH * 4}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


# ---------------------------------------------------------------- child side (one case per process)

def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field))
    return int(line.split()[1]) * 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := current RSS


def _load(case: str, folder: Path, offload: Path) -> nn.Module:
    if case.startswith("floor"):
        from safetensors.torch import load_file

        with torch.device("meta"):
            model = build()
        backend = "pread" if "copy" in case else "mmap"  # pread: read into RAM (what load_file did before 0.8)
        for shard in sorted(folder.glob("*.safetensors")):
            model.load_state_dict(load_file(str(shard), backend=backend), assign=True, strict=False)
        return model
    if case.startswith("hasten"):
        from hasten import init_empty_weights, load_checkpoint_and_dispatch
    else:
        from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    with init_empty_weights():
        model = build()
    kwargs: dict[str, Any] = {}
    if case.endswith("disk"):
        kwargs = {"max_memory": {"cpu": CPU_BUDGET}, "offload_folder": str(offload)}
    return load_checkpoint_and_dispatch(model, str(folder), device_map="auto", **kwargs)


def child(case: str, folder: Path, offload: Path) -> dict[str, Any]:
    # Import both libraries' big-model modules in every case, before the clock starts: same baseline, same
    # import cost paid outside the measurement (hasten imports hasten.big_modeling lazily, on first use).
    try:
        import accelerate.big_modeling  # noqa: F401
    except ImportError:  # the scaling script runs without it (no Accelerate rows)
        pass

    import hasten.big_modeling  # noqa: F401

    x = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(1))
    _reset_peak()
    before = _vm("VmRSS")
    start = time.perf_counter()
    model = _load(case, folder, offload)
    load_s = time.perf_counter() - start
    load_peak = _vm("VmHWM")
    placed = sorted({str(v) for v in getattr(model, "hf_device_map", {"": "cpu"}).values()})
    times, outputs = [], []
    with torch.no_grad():
        for i in range(6):
            if i == 1:  # the first forward pages in what a lazy load left on disk: it counts in the load's peak
                first_peak = _vm("VmHWM")
                _reset_peak()
                forward_before = _vm("VmRSS")
            start = time.perf_counter()
            outputs.append(model(x))
            times.append(time.perf_counter() - start)
    same = all(torch.equal(outputs[0], out) for out in outputs[1:])
    return {"load_s": load_s, "peak": load_peak, "growth": load_peak - before, "placed": placed,
            "first_s": load_s + times[0], "first_peak": first_peak,
            "forward_s": statistics.median(times[1:]), "forward3_s": times[2], "forward_growth": _vm("VmHWM") - forward_before,
            "out_sum": float(outputs[0].double().abs().sum()), "repeat_equal": same,
            "offload_mb": sum(p.stat().st_size for p in offload.rglob("*") if p.is_file()) / 1e6,
            "threads": torch.get_num_threads()}


# ---------------------------------------------------------------- parent side

def run_case(case: str, folder: Path) -> dict[str, Any]:
    offload = Path(tempfile.mkdtemp(prefix="offload-", dir=folder.parent))
    try:
        proc = subprocess.run([sys.executable, __file__, "--child", case, "--folder", str(folder),
                               "--offload", str(offload), "--layers", str(LAYERS), "--width", str(WIDTH),
                               "--cpu-budget", CPU_BUDGET], capture_output=True, text=True, timeout=600)
    finally:
        shutil.rmtree(offload, ignore_errors=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{case} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def report(results: dict[str, list[dict[str, Any]]], repeats: int) -> None:
    mb = 1e6
    print(f"\n{LAYERS} x Linear({WIDTH}, {WIDTH}) = {LAYERS * (WIDTH + 1) * WIDTH * 4 / 1e9:.2f} GB float32, "
          f"{SHARDS} safetensors shards, warm page cache, median of {repeats} fresh processes "
          f"(torch threads: {results['hasten auto'][0]['threads']}); disk = max_memory cpu {CPU_BUDGET}")
    print(f"  {'case':16s} {'load s':>7s} {'+fwd1 s':>8s} {'peak MB':>8s} {'growth':>7s} {'peak+fwd1':>10s} "
          f"{'fwd2-6 s':>8s} {'fwd3 s':>7s} {'fwd2-6 growth':>14s} {'offload MB':>11s}  placement")
    ref = results["floor (mmap)"][0]["out_sum"]
    for case, runs in results.items():
        wrong = [r["out_sum"] for r in runs if abs(r["out_sum"] - ref) > 1e-6 * abs(ref) or not r["repeat_equal"]]
        print(f"  {case:16s} {_median(runs, 'load_s'):7.3f} {_median(runs, 'first_s'):8.3f} "
              f"{_median(runs, 'peak') / mb:8.0f} {_median(runs, 'growth') / mb:7.0f} "
              f"{_median(runs, 'first_peak') / mb:10.0f} {_median(runs, 'forward_s'):8.3f} "
              f"{_median(runs, 'forward3_s'):7.3f} {_median(runs, 'forward_growth') / mb:14.0f} "
              f"{_median(runs, 'offload_mb'):11.0f}  {'+'.join(runs[0]['placed'])}"
              + (f"  OUTPUT DIFFERS from the floor: {wrong}" if wrong else ""))
    print("  (load s: empty build + load call; +fwd1 s: until the first output, which pages in what a lazy load\n"
          "   left unread; peak MB: VmHWM after the load, growth: over the RSS before it; peak+fwd1: VmHWM through\n"
          "   the first forward; fwd2-6 s: median of forwards 2-6; fwd2-6 growth: VmHWM growth over them)")
    m = {case: {k: _median(runs, k) for k in ("load_s", "first_s", "peak", "first_peak", "forward_s")}
         for case, runs in results.items()}
    h, hd = m["hasten auto"], m["hasten disk"]
    nan = {k: float("nan") for k in ("load_s", "first_s", "peak", "first_peak", "forward_s")}
    a, ad = m.get("accelerate auto", nan), m.get("accelerate disk", nan)  # nan: Accelerate not installed
    checks = [
        ("auto load / floor (mmap)", h["load_s"] / m["floor (mmap)"]["load_s"], 1.3),
        ("auto load / floor (copy)", h["load_s"] / m["floor (copy)"]["load_s"], 1.3),
        ("auto load+fwd1 / floor (mmap) load+fwd1", h["first_s"] / m["floor (mmap)"]["first_s"], 1.1),
        ("auto steady forward / floor (mmap)", h["forward_s"] / m["floor (mmap)"]["forward_s"], 1.05),
        ("disk load / accelerate disk load", hd["load_s"] / ad["load_s"], 0.3),
        ("disk load+fwd1 / accelerate", hd["first_s"] / ad["first_s"], 0.3),
        ("disk fwd2 / accelerate disk fwd2", hd["forward_s"] / ad["forward_s"], 0.7),
        # "no higher than": 1.01 so that a tie (both at the interpreter's baseline) is not read as a miss
        ("auto peak RSS (load) / accelerate", h["peak"] / a["peak"], 1.01),
        ("auto peak RSS (load+fwd1) / accelerate", h["first_peak"] / a["first_peak"], 1.01),
        ("disk peak RSS (load) / accelerate", hd["peak"] / ad["peak"], 1.01),
        ("disk peak RSS (load+fwd1) / accelerate", hd["first_peak"] / ad["first_peak"], 1.01),
    ]
    print("\n  hasten vs target                           ratio  target  met")
    for name, ratio, target in checks:
        met = "n/a" if ratio != ratio else ("yes" if ratio <= target else "NO")
        print(f"  {name:40s} {ratio:6.2f}x {target:5.2f}x  {met}")
    print(f"  (accelerate auto load / floor (copy): {a['load_s'] / m['floor (copy)']['load_s']:.2f}x; "
          f"hasten auto load - floor (mmap): {1e3 * (h['load_s'] - m['floor (mmap)']['load_s']):.0f} ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child")
    parser.add_argument("--folder", type=Path)
    parser.add_argument("--offload", type=Path)
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--width", type=int, default=WIDTH)
    parser.add_argument("--cpu-budget", default=CPU_BUDGET, help="max_memory['cpu'] of the disk cases")
    parser.add_argument("--quick", action="store_true", help="one short repeat: checks the script works (not a measurement)")
    args = parser.parse_args()
    if args.quick:  # a 100 MB model, one repeat
        args.repeats, args.layers, args.width, args.cpu_budget = 1, 6, 2048, "40MB"
    configure(args.layers, args.width, args.cpu_budget)
    if args.child:
        print(json.dumps(child(args.child, args.folder, args.offload)))
        return
    if shutil.disk_usage(tempfile.gettempdir()).free < 6e9:
        sys.exit(f"need ~6 GB free in {tempfile.gettempdir()} (checkpoint + Accelerate's offload copy)")
    root = Path(tempfile.mkdtemp(prefix="bench-big-model-"))
    try:
        folder = root / "checkpoint"
        folder.mkdir()
        write_checkpoint(folder)
        for shard in folder.glob("*.safetensors"):  # warm the page cache
            with open(shard, "rb") as f:
                while f.read(1 << 24):
                    pass
        try:
            import accelerate  # noqa: F401
            cases = CASES
        except ImportError:
            print("accelerate is not installed: its cases are skipped (`pip install accelerate` to include them)")
            cases = tuple(c for c in CASES if not c.startswith("accelerate"))
        results: dict[str, list[dict[str, Any]]] = {case: [] for case in cases}
        for i in range(args.repeats):
            for case in cases:  # interleaved, so machine drift hits every case alike
                results[case].append(run_case(case, folder))
            print(f"repeat {i + 1}/{args.repeats} done", flush=True)
        report(results, args.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
