"""Per-step overhead of hasten's training step over the hand-written loop, and where it goes.

The tiny-MLP loop of ``bench_training.py`` (``next(it)``, forward, loss, ``backward``, ``step``,
``zero_grad``) runs in one process (plain PyTorch vs hasten) or on 2 gloo ranks (DDP +
DistributedSampler vs hasten). Both loops live in the same process and are timed interleaved, many
short repeats each, so machine load hits both alike; the median difference is hasten's overhead per
step. ``--profile`` then runs each loop under cProfile and lists the functions hasten's loop calls that
the hand-written one does not (calls per step and own time per step under the profiler, which inflates
Python-level costs but attributes them).

    PYTHONPATH=src python benchmarks/profile_step.py --ranks 1 --profile
    PYTHONPATH=src python benchmarks/profile_step.py --ranks 2
    PYTHONPATH=src python benchmarks/profile_step.py --ranks 1 --accumulate 2 --scheduler  # the full loop
    PYTHONPATH=src python benchmarks/profile_step.py --ranks 2 --callgrind  # instructions/step, exact

``--callgrind`` reruns the script under valgrind (``apt-get install valgrind``) with instrumentation
off until the measured loops, and prints instructions per step for each loop: insensitive to load.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import glob
import json
import os
import pstats
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from hasten.testing import run_on_ranks

BATCH = 32
WARMUP = 20


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10), nn.LogSoftmax(dim=1))


def _data(n: int) -> TensorDataset:
    # One batch more than the loops take: a prepared loader reads one batch ahead (to know the last
    # batch), and reading past the end would make RandomSampler draw a second full permutation that
    # the hand-written loop, stopping one batch short of the end, never pays. At an epoch's end a
    # hand-written loop pays it too.
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g))


def _hand_written(steps: int, world: int, opts: dict[str, Any]) -> Callable[[int], tuple[float, float]]:
    torch.manual_seed(0)
    model: nn.Module = _mlp()
    data = _data(BATCH * (steps + WARMUP + 1) * world)  # +1: see _data
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
        loader = DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, shuffle=True, seed=0))
    else:
        loader = DataLoader(data, batch_size=BATCH, shuffle=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 10**9) if opts["scheduler"] else None
    accumulate = opts["accumulate"]

    def run(n: int) -> tuple[float, float]:
        it = iter(loader)
        for _ in range(WARMUP):
            x, y = next(it)
            F.nll_loss(model(x), y).backward()
        optimizer.zero_grad()
        start, cpu = time.perf_counter(), time.thread_time()
        for i in range(n):
            x, y = next(it)
            if accumulate > 1:  # what a careful hand-written DDP loop does: skip the all-reduce in between
                last = (i + 1) % accumulate == 0
                if world > 1 and not last:
                    with model.no_sync():  # type: ignore[operator]
                        (F.nll_loss(model(x), y) / accumulate).backward()
                else:
                    (F.nll_loss(model(x), y) / accumulate).backward()
                if last:
                    optimizer.step()
                    if scheduler is not None:
                        for _ in range(world):
                            scheduler.step()
                    optimizer.zero_grad()
                continue
            F.nll_loss(model(x), y).backward()
            optimizer.step()
            if scheduler is not None:
                for _ in range(world):
                    scheduler.step()
            optimizer.zero_grad()
        return time.perf_counter() - start, time.thread_time() - cpu

    return run


def _hasten(steps: int, world: int, opts: dict[str, Any]) -> Callable[[int], tuple[float, float]]:
    from hasten import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=opts["accumulate"])
    torch.manual_seed(0)
    model = _mlp()
    data = _data(BATCH * (steps + WARMUP + 1) * world)  # +1: see _data
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(data, batch_size=BATCH, shuffle=True)
    objects: list[Any] = [model, optimizer, loader]
    if opts["scheduler"]:
        objects.append(torch.optim.lr_scheduler.StepLR(optimizer, 10**9))
    prepared = accelerator.prepare(*objects)
    model, optimizer, loader = prepared[:3]
    scheduler = prepared[3] if opts["scheduler"] else None
    accumulate = opts["accumulate"] > 1

    def run(n: int) -> tuple[float, float]:
        it = iter(loader)
        for _ in range(WARMUP):
            x, y = next(it)
            accelerator.backward(F.nll_loss(model(x), y))
        optimizer.zero_grad()
        start, cpu = time.perf_counter(), time.thread_time()
        for _ in range(n):
            x, y = next(it)
            if accumulate:
                with accelerator.accumulate(model):
                    accelerator.backward(F.nll_loss(model(x), y))
                    optimizer.step()
                    if scheduler is not None:
                        scheduler.step()
                    optimizer.zero_grad()
                continue
            accelerator.backward(F.nll_loss(model(x), y))
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            optimizer.zero_grad()
        return time.perf_counter() - start, time.thread_time() - cpu

    return run


def _profile(run: Callable[[int], tuple[float, float]], steps: int) -> dict[tuple[str, int, str], tuple[int, float]]:
    profiler = cProfile.Profile(time.thread_time)  # CPU time: a preempted frame is not charged the wait
    profiler.enable()
    run(steps)
    profiler.disable()
    stats: Any = pstats.Stats(profiler).stats  # type: ignore[attr-defined]  # set at runtime, absent from the stub
    return {key: (value[1], value[2]) for key, value in stats.items()}  # (primitive calls, own time)


def _callgrind(*command: str) -> None:
    subprocess.run(["callgrind_control", *command, str(os.getpid())], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)


def _count_instructions(loops: dict[str, Callable[[int], tuple[float, float]]], steps: int, world: int) -> dict[str, int]:
    """Instructions each loop executes for ``steps`` steps (this process runs under callgrind, not instrumenting)."""
    _callgrind("--instr=on")
    counts = {}
    for name, run in loops.items():
        if world > 1:
            torch.distributed.barrier()
        _callgrind("--zero")
        run(steps)
        _callgrind(f"--dump={name}")
    _callgrind("--instr=off")
    for path in glob.glob(f"{os.environ['HASTEN_PROFILE_CALLGRIND']}.{os.getpid()}.*"):
        with open(path) as f:
            text = f.read()
        trigger = re.search(r"^desc: Trigger: dump (.+)$", text, re.M)
        total = re.search(r"^totals: (\d+)$", text, re.M)
        if trigger and total and trigger.group(1) in loops:
            counts[trigger.group(1)] = int(total.group(1))
    return counts


def _rank_body(world: int, steps: int, repeats: int, profile: bool, opts: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    loops = {"hand-written": _hand_written(steps, world, opts), "hasten": _hasten(steps, world, opts)}
    if "HASTEN_PROFILE_CALLGRIND" in os.environ:
        for run in loops.values():
            run(steps)
        return {"instructions": _count_instructions(loops, steps, world)}
    times: dict[str, list[float]] = {name: [] for name in loops}
    cpu_times: dict[str, list[float]] = {name: [] for name in loops}
    for run in loops.values():
        run(steps)  # warm both (first-pass allocations, lazy imports)
    for _ in range(repeats):
        for name, run in loops.items():  # interleaved: drift and load hit both alike
            if world > 1:
                torch.distributed.barrier()
            wall, cpu = run(steps)
            times[name].append(wall / steps * 1e6)
            cpu_times[name].append(cpu / steps * 1e6)
    result: dict[str, Any] = {"wall": times, "cpu": cpu_times}
    if profile:
        result["profiles"] = {name: _profile(run, steps) for name, run in loops.items()}
    return result


def _where(key: tuple[str, int, str]) -> str:
    filename, line, name = key
    if filename == "~":
        return name
    short = filename.split("/site-packages/")[-1].split("/src/")[-1]
    return f"{short}:{line}({name})"


def _report_profile(profiles: dict[str, Any], steps: int, top: int) -> None:
    hand, ours = profiles["hand-written"], profiles["hasten"]
    rows = []
    for key, (calls, own) in ours.items():
        base_calls, base_own = hand.get(key, (0, 0.0))
        extra_calls = calls - base_calls
        if extra_calls <= 0:  # own-time differences of shared functions are noise on a loaded machine
            continue
        rows.append((own * extra_calls / calls, extra_calls, key))
    rows.sort(reverse=True)
    total_calls = sum(c for c, _ in ours.values()) - sum(c for c, _ in hand.values())
    total_own = sum(t for _, t in ours.values()) - sum(t for _, t in hand.values())
    extra_own = sum(t for t, _, _ in rows)
    print(f"\nunder cProfile: hasten makes {total_calls / steps:+.1f} calls/step more than hand-written, "
          f"{extra_own / steps * 1e6:.1f} us/step in them (own time, profiler-inflated; all frames "
          f"{total_own / steps * 1e6:+.1f} us/step); the extra calls:")
    print(f"  {'us/step':>8s} {'calls/step':>10s}  function")
    for extra_time, extra_calls, key in rows[:top]:
        print(f"  {extra_time / steps * 1e6:8.2f} {extra_calls / steps:10.2f}  {_where(key)}")


def _rerun_under_callgrind(world: int, keep: str | None) -> list[Any]:
    """Run this script's ranks again, each under callgrind (not instrumenting until the measured loops).

    callgrind_control cannot reach a forked child, so each rank is its own valgrind process; they meet
    at a FileStore in a temporary folder.
    """
    with tempfile.TemporaryDirectory(prefix="hasten-callgrind-") as temporary:
        folder = keep or temporary
        os.makedirs(folder, exist_ok=True)
        out = os.path.join(folder, "cg")
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}.%p",
                   sys.executable, *sys.argv]
        quiet = None if os.environ.get("HASTEN_PROFILE_VERBOSE") else subprocess.DEVNULL
        ranks = [subprocess.Popen(command, stderr=quiet, env={
            **os.environ, "HASTEN_PROFILE_CALLGRIND": out, "RANK": str(rank), "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500"}) for rank in range(world)]  # the port is never used: FileStore rendezvous
        if any(p.wait() != 0 for p in ranks):
            raise RuntimeError("a rank failed under callgrind (HASTEN_PROFILE_VERBOSE=1 shows valgrind's output)")
        results = []
        for rank in range(world):
            with open(f"{out}.rank{rank}.json") as f:
                results.append(json.load(f))
        return results


def _callgrind_rank(world: int, steps: int, opts: dict[str, Any]) -> None:
    """One rank under callgrind: join the others, count, write the counts next to callgrind's files."""
    from hasten.runtime.process_group import end_group, start_group

    rank, out = int(os.environ["RANK"]), os.environ["HASTEN_PROFILE_CALLGRIND"]
    store = torch.distributed.FileStore(f"{out}.store", world)
    start_group(backend="gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(hours=1))
    result = _rank_body(world, steps, 0, False, opts)
    end_group(barrier=True)
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(result, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1, choices=(1, 2))
    parser.add_argument("--steps", type=int, default=500, help="steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--profile", action="store_true", help="also list hasten-only functions (cProfile)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--accumulate", type=int, default=1, help="gradient accumulation steps (uses accumulate())")
    parser.add_argument("--scheduler", action="store_true", help="also step a prepared LR scheduler")
    parser.add_argument("--callgrind", action="store_true",
                        help="count instructions per step under valgrind's callgrind instead of timing (slow, exact)")
    parser.add_argument("--callgrind-dir", help="keep callgrind's files here (read them with callgrind_annotate)")
    args = parser.parse_args()
    opts = {"accumulate": args.accumulate, "scheduler": args.scheduler}
    if "HASTEN_PROFILE_CALLGRIND" in os.environ:  # a rank started by _rerun_under_callgrind
        _callgrind_rank(args.ranks, args.steps, opts)
        return
    if args.callgrind:
        results = _rerun_under_callgrind(args.ranks, args.callgrind_dir)
        print(f"tiny MLP, {args.ranks} process(es), {args.steps} steps, accumulate={args.accumulate}, "
              f"scheduler={args.scheduler}: instructions per step (callgrind)")
        for rank, result in enumerate(results):
            hand, ours = (result["instructions"][k] / args.steps for k in ("hand-written", "hasten"))
            print(f"rank {rank}: hand-written {hand:10.0f}  hasten {ours:10.0f}  overhead {ours - hand:+8.0f} "
                  f"instructions/step ({hand / ours:.3f}x)")
        return
    results = run_on_ranks(_rank_body, world_size=args.ranks, timeout=1800,
                           args=(args.ranks, args.steps, args.repeats, args.profile, opts))
    print(f"tiny MLP, {args.ranks} process(es), {args.steps} steps x {args.repeats} interleaved repeats, "
          f"accumulate={args.accumulate}, scheduler={args.scheduler}")
    for rank, result in enumerate(results):
        for clock in ("wall", "cpu"):  # cpu: the main thread's CPU time, less disturbed by other load
            times = result[clock]
            hand, ours = statistics.median(times["hand-written"]), statistics.median(times["hasten"])
            diffs = [h - b for h, b in zip(times["hasten"], times["hand-written"])]
            print(f"rank {rank} {clock:4s}: hand-written {hand:7.1f} us/step (min {min(times['hand-written']):6.1f}), "
                  f"hasten {ours:7.1f} (min {min(times['hasten']):6.1f}); overhead: median paired difference "
                  f"{statistics.median(diffs):+6.1f} us/step, difference of mins "
                  f"{min(times['hasten']) - min(times['hand-written']):+6.1f}; ratio of medians {hand / ours:.3f}x")
    if args.profile:
        _report_profile(results[0]["profiles"], args.steps, args.top)


if __name__ == "__main__":
    main()
