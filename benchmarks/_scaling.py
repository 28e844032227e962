"""Shared plumbing of the growth-curve benchmarks (``bench_scaling_*.py``): options, medians, output.

Every script measures hasten, the hand-written floor and (when ``import accelerate`` works in this
interpreter) Accelerate in one run, interleaved, and writes three files into ``--out``:

  * ``<name>.md``: the table, with the command, the machine and the date;
  * ``<name>.png``: the curves (matplotlib);
  * ``<name>.json``: the raw figures and the summary rows ``run_benchmarks.py`` prints.

``--quick`` shrinks sizes and repeats so that all scripts together stay within a few minutes on 2 cores
and writes into ``.tmp/bench`` unless ``--out`` says otherwise: quick figures check that the scripts
work and show the trend; the documented ones come from full runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCS_OUT = ROOT / "docs" / "scaling"
QUICK_OUT = ROOT / ".tmp" / "bench"


def parser(description: str) -> argparse.ArgumentParser:
    """The options every scaling script takes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="small sizes, one repeat (what `make bench` runs)")
    p.add_argument("--repeats", type=int, default=None, help="fresh runs per point (median); default 3, quick 1")
    p.add_argument("--out", type=Path, default=None, help=f"output folder (default {DOCS_OUT}, quick: {QUICK_OUT})")
    return p


def finish_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults that depend on ``--quick``."""
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.out is None:
        args.out = QUICK_OUT if args.quick else DOCS_OUT
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def have_accelerate() -> bool:
    """True when Accelerate can be imported here (its rows are then measured beside hasten's)."""
    try:
        import accelerate  # noqa: F401
    except ImportError:
        print("accelerate is not importable in this interpreter: its rows are left out "
              "(`make bench` uses .bench-venv, which has it)", file=sys.stderr)
        return False
    return True


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def median_chunk_time(step: Callable[[], None], steps: int, clock: Callable[[], float], chunks: int = 10) -> float:
    """Seconds per step: the median over ``chunks`` equal runs of ``steps / chunks`` steps.

    A burst of other work on the machine spoils one chunk, not the figure (a plain mean over all steps
    takes it in whole).
    """
    per_chunk = max(1, steps // chunks)
    times = []
    for _ in range(max(1, steps // per_chunk)):
        start = clock()
        for _ in range(per_chunk):
            step()
        times.append((clock() - start) / per_chunk)
    return statistics.median(times)


def machine() -> str:
    """One line naming the machine, for the tables."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        import accelerate

        acc = f", Accelerate {accelerate.__version__}"
    except ImportError:
        acc = ""
    load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    return (f"{os.cpu_count()} logical CPUs ({cpu}), Python {platform.python_version()}, PyTorch {torch.__version__}"
            f"{acc}{load}")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_outputs(args: argparse.Namespace, name: str, title: str, header: Sequence[str],
                  rows: Sequence[Sequence[Any]], data: dict[str, Any], summary: list[dict[str, Any]],
                  notes: str = "") -> None:
    """Write ``<name>.md`` and ``<name>.json`` into ``args.out`` and print the table."""
    command = " ".join(["python", f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]])
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    table = markdown_table(header, rows)
    mode = "quick mode (small sizes, 1 repeat: a smoke test, not a measurement)" if args.quick else \
        f"median of {args.repeats} fresh runs per point"
    text = (f"**{title}** (`{command}`; {mode}; {when}; {machine()})\n\n{table}\n"
            + (f"\n{notes}\n" if notes else ""))
    (args.out / f"{name}.md").write_text(text)
    (args.out / f"{name}.json").write_text(json.dumps({"name": name, "title": title, "quick": args.quick,
                                                       "data": data, "summary": summary}, indent=1, default=str))
    print(f"\n{title}\n{table}\n{notes}\nwritten: {args.out / name}.md, .png, .json")


def plot(args: argparse.Namespace, name: str, title: str, xlabel: str, ylabel: str,
         series: dict[str, tuple[Sequence[float], Sequence[float]]], logx: bool = False,
         hline: float | None = None, second: tuple[str, dict[str, tuple[Sequence[float], Sequence[float]]]] | None = None
         ) -> None:
    """One PNG: a line per series (and an optional second panel), into ``args.out/<name>.png``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return
    panels = 2 if second else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.4 * panels, 4.2), squeeze=False)
    for ax, (label, data) in zip(axes[0], [(ylabel, series)] + ([second] if second else [])):
        for key, (xs, ys) in data.items():
            ax.plot(xs, ys, marker="o", label=key)
        values = [y for _, ys in data.values() for y in ys if y == y and y > 0]
        if values and max(values) / min(values) > 30:  # spans orders of magnitude (e.g. oversubscribed ranks)
            ax.set_yscale("log")
        if hline is not None and ax is axes[0][0]:
            ax.axhline(hline, color="grey", linestyle=":", linewidth=1)
        if logx:
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted({x for xs, _ in data.values() for x in xs}))
            ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel(xlabel)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title + (" (quick mode)" if args.quick else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out / f"{name}.png", dpi=110)
    plt.close(fig)
