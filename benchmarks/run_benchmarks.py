"""Run every growth-curve benchmark (``bench_scaling_*.py``) and print one summary table.

    python benchmarks/run_benchmarks.py --quick        # what `make bench` runs: a few minutes on 2 cores
    python benchmarks/run_benchmarks.py                # full sizes and repeats, tables + PNGs into docs/scaling/

Each script runs in its own process (so one failure does not stop the others) and leaves
``<name>.json``; the summary reads them back: one row per (benchmark, point, metric) with hasten's and
Accelerate's ratio to the floor of that benchmark and the target.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import _scaling

SCRIPTS = {  # name -> script (the name is the output file stem)
    "prepared": "bench_scaling_prepared.py",
    "world_size": "bench_scaling_world_size.py",
    "launch": "bench_scaling_launch.py",
    "big_model": "bench_scaling_big_model.py",
    "checkpoint": "bench_scaling_checkpoint.py",
    "async_checkpoint": "bench_scaling_async_checkpoint.py",
}


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--only", nargs="+", choices=list(SCRIPTS), default=list(SCRIPTS))
    args = parser.parse_args()
    out = args.out or (_scaling.QUICK_OUT if args.quick else _scaling.DOCS_OUT)
    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(here), os.environ.get("PYTHONPATH")])))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    failed, took = [], {}
    for name in args.only:
        cmd = [sys.executable, str(here / SCRIPTS[name]), "--out", str(out)]
        cmd += ["--quick"] if args.quick else []
        cmd += ["--repeats", str(args.repeats)] if args.repeats else []
        print(f"\n=== {' '.join(cmd[1:])}", flush=True)
        start = time.perf_counter()
        if subprocess.run(cmd, env=env, timeout=3600).returncode != 0:
            failed.append(name)
        took[name] = time.perf_counter() - start
    rows = []
    for name in args.only:
        path = out / f"{name}.json"
        if name in failed or not path.is_file():
            rows.append([name, "-", "FAILED", "-", "-", "-"])
            continue
        for row in json.loads(path.read_text())["summary"]:
            rows.append([row["benchmark"], row["point"], row["metric"], _ratio(row["hasten"]),
                         _ratio(row["accelerate"]), row["target"]])
    print("\nSummary (ratios to each benchmark's floor; lower is better)"
          + (" -- QUICK MODE: a smoke test under whatever load the machine has, not a measurement" if args.quick
             else ""))
    print(_scaling.markdown_table(["benchmark", "point", "metric", "hasten", "Accelerate", "target"], rows))
    print("time per script: " + ", ".join(f"{n} {s:.0f}s" for n, s in took.items())
          + f"; total {sum(took.values()):.0f}s; outputs in {out}")
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
