"""Preemption: signal-to-exit time of ``hasten launch`` with a large state, and the step overhead of the machinery.

1. ``hasten launch --cpu --num_processes 2`` trains a model whose weights plus AdamW state come to
   ``--state-gb`` (0.8 GB by default, per process); after two steps the launcher gets SIGTERM (as
   Kubernetes sends it). Reported: seconds from the signal to the launcher's exit (measured here, and as
   the launcher logs it), the step time, the checkpoint's size on disk, the exit code (75 expected).
2. The tiny-MLP step rate with the preemption machinery armed (hasten always arms it at ``prepare``)
   against hand-written DDP / plain PyTorch, paired in one process (``bench_training.run_paired``).

    python benchmarks/bench_preemption.py --repeats 2 --rounds 20
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_training

SCRIPT = """
import os, sys, time
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from hasten import Accelerator, ProjectConfiguration

project, marker, params = sys.argv[1], sys.argv[2], int(sys.argv[3])
width = 1024
layers = max(1, params // (width * width))
accelerator = Accelerator(project_config=ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True))
model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randn(64 * 1000, width)
loader = DataLoader(TensorDataset(x), batch_size=8)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
start = None
for index, (batch,) in enumerate(loader):
    accelerator.backward(model(batch).square().mean())
    optimizer.step()
    optimizer.zero_grad()
    if index == 0:
        start = time.perf_counter()
    if index == 2 and accelerator.is_main_process:
        print(f"STEP {(time.perf_counter() - start) / 2:.3f}", flush=True)
        open(marker, "w").close()
"""


def signal_to_exit(state_gb: float, workdir: Path) -> dict[str, float]:
    """One launch: SIGTERM to the launcher after two steps; the timings and sizes."""
    params = int(state_gb * 1e9 / 4 / 3)  # fp32 weights + AdamW's two moments
    script, project, marker = workdir / "train.py", workdir / "project", workdir / "mark"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    env.pop("HASTEN_LAUNCH_CONFIG", None)
    proc = subprocess.Popen([sys.executable, "-m", "hasten.commands.main", "launch", "--cpu", "--num_processes", "2",
                             "--preemption_grace", "120", str(script), str(project), str(marker), str(params)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if not marker.exists():
            raise RuntimeError("the workers never reached step 2:\n" + proc.communicate(timeout=60)[0])
        signalled = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=600)
        took = time.perf_counter() - signalled
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    logged = re.search(r"([\d.]+) s from the signal to the exit", out)
    step = re.search(r"STEP ([\d.]+)", out)
    if proc.returncode != 75 or logged is None or step is None:
        raise RuntimeError(f"unexpected end (exit code {proc.returncode}):\n{out}")
    size = sum(f.stat().st_size for f in (project / "checkpoints").rglob("*") if f.is_file())
    return {"wall": took, "logged": float(logged.group(1)), "step": float(step.group(1)), "size_gb": size / 1e9,
            "params_m": params / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-gb", type=float, default=0.8, help="weights + AdamW state per process")
    parser.add_argument("--repeats", type=int, default=2, help="preempted launches")
    parser.add_argument("--rounds", type=int, default=20, help="alternating blocks in the paired step-rate runs")
    parser.add_argument("--quick", action="store_true", help="a small state and few rounds: checks the script works")
    args = parser.parse_args()
    if args.quick:
        args.state_gb, args.repeats, args.rounds = 0.05, 1, 2
    runs = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="hasten-bench-preempt-") as folder:
            runs.append(signal_to_exit(args.state_gb, Path(folder)))
    print(f"\nsignal -> exit, hasten launch --cpu --num_processes 2, {args.state_gb} GB of state per process "
          f"({runs[0]['params_m']:.0f} M parameters + AdamW), checkpoint {runs[0]['size_gb']:.2f} GB on disk, "
          f"one step {statistics.median(r['step'] for r in runs):.2f} s:")
    print("  measured here (s): " + ", ".join(f"{r['wall']:.1f}" for r in runs)
          + f"; median {statistics.median(r['wall'] for r in runs):.1f}")
    print("  logged by the launcher (s): " + ", ".join(f"{r['logged']:.1f}" for r in runs))
    names = ["hand-written", "hasten"]
    for distributed in (True, False):
        rates = bench_training._in_fresh_process(bench_training.run_paired, names, "mlp", distributed, args.rounds,
                                                 distributed=distributed)
        ratios = [a / b for a, b in zip(rates["hasten"], rates["hand-written"])]
        q1, q2, q3 = bench_training._quartiles(ratios)
        setting = "2 gloo ranks" if distributed else "1 process"
        print(f"\ntiny MLP ({setting}), preemption armed, paired blocks: hand-written "
              f"{statistics.median(rates['hand-written']):.1f} steps/s, hasten {statistics.median(rates['hasten']):.1f} "
              f"steps/s, ratio {q2:.3f}x (quartiles {q1:.3f}-{q3:.3f})")


if __name__ == "__main__":
    main()
