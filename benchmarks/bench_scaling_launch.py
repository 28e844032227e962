"""Launcher start-up vs process count: `hasten launch`, torchrun and `accelerate launch` at 1, 2, 4, 8 processes.

Every launcher runs the same worker script, which prints a timestamp on its first line (before importing
torch), then makes a gloo process group from the launcher's environment (``env://``) and passes one
barrier, prints a second timestamp, and exits. Measured from just before the launcher is started:

  * first line: the earliest first-line timestamp of any worker (launcher start-up and process spawn);
  * ready group: the latest post-barrier timestamp (every rank has joined the group);
  * exit: until the launcher itself has returned (teardown included).

Commands: ``hasten launch --num_processes N``, ``torchrun --standalone --nproc_per_node N`` and
``accelerate launch --multi_gpu --num_processes N`` (its CPU multi-process path needs mpirun; the
``--multi_gpu`` path is torchrun's agent, which is what a user on CPUs gets), each with a free port.
At 1 process the worker makes a one-rank group from a file store when the launcher gives no rendezvous
(hasten and accelerate run the script directly). Runs are interleaved; medians over --repeats.

    python benchmarks/bench_scaling_launch.py            # full: 1, 2, 4, 8 processes, 3 repeats
    python benchmarks/bench_scaling_launch.py --quick    # smoke test
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _scaling

WORKER = r'''
import os, sys, time
# one os.write per line: ranks share the launcher's pipe, and print() may split a line over several writes
os.write(1, f"FIRST {time.time()}\n".encode())
import torch.distributed as dist
if "MASTER_ADDR" in os.environ and "WORLD_SIZE" in os.environ:
    dist.init_process_group("gloo")
else:  # a launcher that runs one process directly gives no rendezvous: a one-rank group
    dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1] + ".store", 1), rank=0, world_size=1)
dist.barrier()
os.write(1, f"READY {time.time()}\n".encode())
dist.destroy_process_group()
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _command(launcher: str, n: int, script: str, scratch: str) -> list[str]:
    py = sys.executable
    if launcher == "hasten launch":
        return [py, "-m", "hasten.commands.main", "launch", "--num_processes", str(n), "--main_process_port",
                str(_free_port()), script, scratch]
    if launcher == "torchrun":
        return [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n), script, scratch]
    if n == 1:
        return [py, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
                "--mixed_precision", "no", "--dynamo_backend", "no", script, scratch]
    return [py, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(n), "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
            script, scratch]


def _once(launcher: str, n: int, script: str, folder: Path) -> dict[str, float]:
    scratch = str(folder / f"run-{time.monotonic_ns()}")
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    env.pop("ACCELERATE_CONFIG_FILE", None)
    start = time.time()
    proc = subprocess.run(_command(launcher, n, script, scratch), env=env, capture_output=True, text=True,
                          timeout=600, cwd=folder)
    end = time.time()
    if proc.returncode != 0:
        raise RuntimeError(f"{launcher} with {n} processes failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    first = [float(t) for t in re.findall(r"FIRST (\d+\.\d+)", proc.stdout)]
    ready = [float(t) for t in re.findall(r"READY (\d+\.\d+)", proc.stdout)]
    if len(first) != n or len(ready) != n:
        raise RuntimeError(f"{launcher} with {n} processes: expected {n} workers, saw {len(first)}/{len(ready)}:\n"
                           f"{proc.stdout[-2000:]}")
    return {"first": min(first) - start, "ready": max(ready) - start, "exit": end - start}


def main() -> None:
    parser = _scaling.parser(__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=None)
    args = _scaling.finish_args(parser.parse_args())
    sizes = args.sizes or ([1, 2, 4] if args.quick else [1, 2, 4, 8])
    launchers = ["torchrun", "hasten launch"] + (["accelerate launch"] if _scaling.have_accelerate() else [])
    folder = Path(tempfile.mkdtemp(prefix="bench-launch-"))
    try:
        script = str(folder / "worker.py")
        Path(script).write_text(WORKER)
        runs: dict[str, dict[int, list[dict[str, float]]]] = {la: {n: [] for n in sizes} for la in launchers}
        for n in sizes:
            for _ in range(args.repeats):
                for launcher in launchers:  # interleaved: drift hits every launcher alike
                    runs[launcher][n].append(_once(launcher, n, script, folder))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    med = {la: {n: {k: _scaling.median([r[k] for r in per[n]]) for k in ("first", "ready", "exit")}
                for n in sizes} for la, per in runs.items()}
    header = ["processes"] + [f"{la}: first line / ready group / exit (s)" for la in launchers] + \
        ["hasten / torchrun (ready)"] + (["hasten / accelerate (ready)"] if "accelerate launch" in med else [])
    rows, summary = [], []
    for n in sizes:
        row: list[object] = [n]
        for la in launchers:
            m = med[la][n]
            row.append(f"{m['first']:.2f} / {m['ready']:.2f} / {m['exit']:.2f}")
        h, t = med["hasten launch"][n], med["torchrun"][n]
        row.append(f"{h['ready'] / t['ready']:.2f}x")
        if "accelerate launch" in med:
            row.append(f"{h['ready'] / med['accelerate launch'][n]['ready']:.2f}x")
        rows.append(row)
        summary.append({"benchmark": "launch", "point": f"{n} proc", "metric": "time to ready group / torchrun",
                        "hasten": h["ready"] / t["ready"],
                        "accelerate": (med["accelerate launch"][n]["ready"] / t["ready"]
                                       if "accelerate launch" in med else None), "target": "<= 1.0"})
    notes = ("Seconds from starting the launcher (lower is better). Every worker imports torch before the "
             "group forms, so 'ready group' grows with the processes sharing the cores.")
    _scaling.write_outputs(args, "launch", "Launcher start-up vs processes (same worker script, gloo)",
                           header, rows, {"runs": runs}, summary, notes)
    _scaling.plot(args, "launch", "Time to a ready process group vs processes", "processes", "seconds to ready group",
                  {la: (sizes, [med[la][n]["ready"] for n in sizes]) for la in launchers}, logx=True,
                  second=("seconds to first line", {la: (sizes, [med[la][n]["first"] for n in sizes])
                                                    for la in launchers}))


if __name__ == "__main__":
    main()
