"""DDP vs FSDP2 on 2 CPU gloo ranks: per-step time and memory per rank, hasten vs Accelerate.

The model is a stack of residual MLP blocks (transformer-like, ~8.4M parameters); AdamW, batch 32 per
rank. For each setup the script reports, per rank (rank 0):
  * step time: median over --repeats fresh 2-rank runs of the mean time of --steps steps;
    (memory is measured in one more run per setup, see peak RSS);
  * state MB: the bytes this rank holds for parameters + gradients + optimizer state (exact, read
    from the tensors: FSDP2 keeps 1/2 of each, DDP all of it);
  * peak RSS MB: the largest resident-set growth over the process's size before the model was built,
    sampled every millisecond, with large allocations mmap'd so freed memory leaves the RSS (it
    includes torch's own start-up allocations, ~110 MB here, the same for every setup).
Ratios are to hasten's DDP. Accelerate (if installed) runs the same loop with ``cpu=True`` (without
it Accelerate trains each rank alone on a CPU-only machine). Accelerate's FSDP2 does not run on CPU (with
``cpu=True`` it silently falls back to DDP): its row says so instead of reporting DDP numbers.

On gloo, all-gather and reduce-scatter are slower per byte than all-reduce (measured here: 33.6 MB
all-reduce 31 ms, all-gather 46 ms, reduce-scatter 61 ms), and FSDP2 moves ~1.5x DDP's bytes, so
sharding costs time on CPU; it buys the memory column. On GPUs (NCCL) the balance differs.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_sharded.py --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import psutil
import torch
from torch import nn

from hasten.testing import run_on_ranks

WIDTH, DEPTH, BATCH, WARMUP = 256, 8, 32, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 8 * WIDTH)
        self.down = nn.Linear(8 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block() for _ in range(DEPTH)))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


class PeakRSS:
    """Samples this process's RSS in a thread; ``peak`` is the growth over the baseline."""

    def __init__(self) -> None:
        self.process = psutil.Process()
        self.baseline = self.process.memory_info().rss
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss - self.baseline)
            time.sleep(0.001)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def _trim() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: RSS then also counts memory freed but kept by malloc
        pass


def _local_bytes(tensors: Any) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if hasattr(t, "to_local") else t
            total += t.numel() * t.element_size()
    return total


def _state_bytes(model: nn.Module, optimizer: Any) -> int:
    params = list(model.parameters())
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return _local_bytes(params) + _local_bytes(p.grad for p in params if p.grad is not None) + _local_bytes(states)


def _loop(accelerator: Any, steps: int, memory_run: bool) -> tuple[float, float, float]:
    if memory_run:
        _fixed_mmap_threshold()
    with PeakRSS() as rss:
        torch.manual_seed(0)
        model = Stack()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = accelerator.prepare(model, optimizer)
        _trim()  # give freed memory (the unsharded copy) back, so RSS shows what training keeps
        g = torch.Generator().manual_seed(accelerator.process_index)
        x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, 1, generator=g)
        for step in range(WARMUP + steps):
            if step == WARMUP:
                accelerator.wait_for_everyone()
                start = time.perf_counter()
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            if step == WARMUP:  # gradients present, optimizer state built during warm-up
                state_bytes = _state_bytes(model, optimizer)
            optimizer.step()
            optimizer.zero_grad()
        accelerator.wait_for_everyone()
        elapsed = time.perf_counter() - start
    return elapsed / steps * 1e3, state_bytes / 2**20, rss.peak / 2**20


def hasten_run(kind: str, steps: int, memory_run: bool) -> tuple[float, float, float]:
    from hasten import Accelerator
    from hasten.config.plugins.fsdp import FullyShardedDataParallelPlugin

    plugins = {"ddp": None, "fsdp2": FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"]),
               "fsdp2-keep": FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"],
                                                            reshard_after_forward=False)}
    return _loop(Accelerator(fsdp_plugin=plugins[kind]), steps, memory_run)


def accelerate_run(kind: str, steps: int, memory_run: bool) -> tuple[float, float, float]:
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    plugin = None
    if kind == "fsdp2":
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                                transformer_cls_names_to_wrap=["Block"])
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    if plugin is not None and str(accelerator.distributed_type) != "DistributedType.FSDP":
        raise RuntimeError(f"not run: on CPU Accelerate ignores fsdp_plugin and runs {accelerator.distributed_type} "
                           "(plain DDP); without cpu=True each rank trains alone")
    return _loop(accelerator, steps, memory_run)


def _measure(fn: Callable[..., tuple[float, float, float]], kind: str, steps: int, memory_run: bool = False) -> Any:
    try:
        return run_on_ranks(fn, world_size=2, args=(kind, steps, memory_run), timeout=600)[0]
    except Exception as exc:  # a framework that cannot run this setup is reported, not fatal
        return f"failed: {str(exc).strip().splitlines()[-1][:160]}"


def _fixed_mmap_threshold() -> None:
    """Large tensors always mmap'd, so freeing them lowers RSS (glibc otherwise raises its threshold
    after the first free and keeps freed blocks in the heap: RSS then shows history, not live memory).
    Only in the memory runs: an mmap per gathered buffer slows FSDP2's steps down."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD = 64 KiB
    except (OSError, AttributeError):
        print("not glibc: peak RSS includes memory freed but kept by malloc")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    setups: dict[str, tuple[Callable[..., Any], str]] = {
        "hasten ddp": (hasten_run, "ddp"), "hasten fsdp2": (hasten_run, "fsdp2"),
        "hasten fsdp2 (no reshard)": (hasten_run, "fsdp2-keep")}
    try:
        import accelerate  # noqa: F401

        setups.update({"accelerate ddp": (accelerate_run, "ddp"), "accelerate fsdp2": (accelerate_run, "fsdp2")})
    except ImportError:
        print("accelerate is not installed: its rows are skipped")
    results: dict[str, list[Any]] = {name: [] for name in setups}
    for _ in range(args.repeats):
        for name, (fn, kind) in setups.items():  # interleaved, so machine drift hits every setup alike
            results[name].append(_measure(fn, kind, args.steps))
    memory = {name: _measure(fn, kind, args.steps, memory_run=True) for name, (fn, kind) in setups.items()}
    ok = {name: runs for name, runs in results.items() if all(isinstance(r, tuple) for r in runs)}
    base = statistics.median(r[0] for r in ok["hasten ddp"])
    base_state = statistics.median(r[1] for r in ok["hasten ddp"])
    print(f"\n2 gloo ranks, {sum(p.numel() for p in Stack().parameters()) / 1e6:.1f}M parameters, AdamW, "
          f"batch {BATCH}/rank, {args.steps} steps, median of {args.repeats} runs (rank 0):")
    print(f"  {'setup':28s} {'ms/step':>8s} {'vs ddp':>7s} {'state MB':>9s} {'vs ddp':>7s} {'peak RSS MB':>12s}")
    for name, runs in results.items():
        if name not in ok:
            print(f"  {name:28s} {next(r for r in runs if isinstance(r, str))}")
            continue
        ms, state = (statistics.median(r[i] for r in runs) for i in range(2))
        peak = memory[name][2] if isinstance(memory[name], tuple) else float("nan")
        print(f"  {name:28s} {ms:8.2f} {ms / base:6.2f}x {state:9.1f} {state / base_state:6.2f}x {peak:12.1f}")


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        raise
