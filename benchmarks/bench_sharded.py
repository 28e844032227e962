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

DeepSpeed ZeRO-2 and ZeRO-3 rows (if deepspeed is installed) use the same torch AdamW as the client
optimizer and the same JSON config for both libraries: micro-batch 32, fp32, no gradient clipping (as in
the other rows), ``zero_allow_untested_optimizer``. ``accelerator.backward`` runs the engine's backward
and step, so the step time covers the same work as the other rows. Their "state MB" is every distinct
tensor storage the engine keeps between steps (module parameters or, under ZeRO-3, their partitions;
flat parameter groups, fp32 master partitions, gradient partitions and buffers; optimizer states): the
engine also keeps copies the other rows do not have. Accelerate's DeepSpeed integration does not run on
CPU gloo ranks (it counts one process while DeepSpeed sees the whole group): its rows say so.

On gloo, all-gather and reduce-scatter are slower per byte than all-reduce (measured here: 33.6 MB
all-reduce 31 ms, all-gather 46 ms, reduce-scatter 61 ms), FSDP2 moves ~1.5x DDP's bytes and on CPU
runs every collective synchronously, so sharding costs time on CPU; it buys the memory column (hasten's
gloo settings for FSDP2, ``strategies/fsdp2_gloo.py``, take ~10% off its step). On GPUs (NCCL) the
balance differs.

N-D rows (``--nd``): 4 gloo ranks, the same model and batch per data-parallel rank; DDP on 4 ranks is
the baseline, then FSDP2 (shard 4), HSDP (2 replicas x 2 shards), DDP x TP (2 x 2) and FSDP2 x TP
(2 x 2), TP splitting each Block's ``up`` by columns and ``down`` by rows. The state column shows
the sharding beside the ideal DDP state / (dp_shard x tp) (LayerNorms, row-wise biases and the head
stay whole under TP: 0.1% of the parameters). Accelerate rows (if installed) run the same setups
through Accelerate's own ``ParallelismConfig``; on CPU it cannot: with ``cpu=True`` its
``ParallelismConfig`` refuses ``MULTI_CPU``, without it Accelerate counts 1 process, and its TP path
needs transformers. Each such row prints Accelerate's own error.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_sharded.py --repeats 3
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_sharded.py --nd --repeats 1 --steps 5
"""

from __future__ import annotations

import argparse
import importlib.util
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


def _tensors_in(obj: Any) -> list[torch.Tensor]:
    """Tensors held by ``obj`` directly or in a list/tuple/dict attribute (one level deep), with their .grad."""
    found: list[torch.Tensor] = []
    for value in vars(obj).values():
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
        for item in items:
            for t in (item if isinstance(item, (list, tuple)) else [item]):
                if isinstance(t, torch.Tensor):
                    found += [t] + ([t.grad] if t.grad is not None else [])
    return found


def _deepspeed_state_bytes(engine: Any) -> int:
    """Bytes of the distinct storages a DeepSpeed engine keeps (see the module docstring)."""
    zero = engine.optimizer  # DeepSpeed's ZeRO optimizer, wrapping the client torch optimizer
    tensors: list[torch.Tensor] = []
    for p in engine.module.parameters():
        tensors += [p.data] + [t for t in (getattr(p, "ds_tensor", None), p.grad) if t is not None]
    tensors += _tensors_in(zero)
    tensors += [v for s in zero.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.device.type == "cpu"}
    return sum(storages.values())


def _loop(accelerator: Any, steps: int, memory_run: bool) -> tuple[float, float, float]:
    if memory_run:
        _fixed_mmap_threshold()
    with PeakRSS() as rss:
        torch.manual_seed(0)
        model = Stack()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = accelerator.prepare(model, optimizer)
        _trim()  # give freed memory (the unsharded copy) back, so RSS shows what training keeps
        # One batch per data-parallel rank: the ranks of a tensor-parallel group must compute on the same one.
        position = getattr(accelerator, "_data_parallel_position", None)
        g = torch.Generator().manual_seed(position()[1] if position else accelerator.process_index)
        x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, 1, generator=g)
        for step in range(WARMUP + steps):
            if step == WARMUP:
                accelerator.wait_for_everyone()
                start = time.perf_counter()
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            if step == WARMUP:  # gradients present, optimizer state built during warm-up
                state_bytes = (_deepspeed_state_bytes(model) if type(model).__name__ == "DeepSpeedEngine"
                               else _state_bytes(model, optimizer))
            optimizer.step()
            optimizer.zero_grad()
        accelerator.wait_for_everyone()
        elapsed = time.perf_counter() - start
    return elapsed / steps * 1e3, state_bytes / 2**20, rss.peak / 2**20


def _ds_config(kind: str) -> dict[str, Any]:
    """The same DeepSpeed config for both libraries: ZeRO stage from ``kind`` ("zero2"/"zero3"), fp32."""
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": int(kind[-1])}, "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9, "wall_clock_breakdown": False}


def hasten_run(kind: str, steps: int, memory_run: bool) -> tuple[float, float, float]:
    from hasten import Accelerator
    from hasten.config.plugins.fsdp import FullyShardedDataParallelPlugin

    if kind.startswith("zero"):
        from hasten.config.plugins.deepspeed import DeepSpeedPlugin

        return _loop(Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=_ds_config(kind))), steps, memory_run)

    if kind == "fsdp2-stock":
        # What strategies/fsdp2_gloo.py buys: the same FSDP2 run with FSDP2's own collectives on gloo
        # (this forked rank only).
        import hasten.strategies.fsdp2 as fsdp2_strategy

        fsdp2_strategy.uses_gloo = lambda device: False
    plugins = {"ddp": None, "fsdp2": FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"]),
               "fsdp2-stock": FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"]),
               "fsdp2-keep": FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"],
                                                            reshard_after_forward=False)}
    return _loop(Accelerator(fsdp_plugin=plugins[kind]), steps, memory_run)


#: N-D setups on 4 ranks: (dp_replicate, dp_shard, tp).
ND_SETUPS = {"ddp x4": (4, 1, 1), "fsdp2 x4": (1, 4, 1), "hsdp 2x2": (2, 2, 1), "ddp x tp 2x2": (2, 1, 2),
             "fsdp2 x tp 2x2": (1, 2, 2)}


def hasten_nd_run(kind: str, steps: int, memory_run: bool) -> tuple[float, float, float]:
    from hasten import Accelerator, ParallelismConfig
    from hasten.utils import TorchTensorParallelConfig

    replicate, shard, tp = ND_SETUPS[kind]
    if (replicate, shard, tp) == (4, 1, 1):
        return _loop(Accelerator(), steps, memory_run)  # plain DDP, the baseline
    plan = TorchTensorParallelConfig(tp_plan={"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}) if tp > 1 else None
    config = ParallelismConfig(dp_replicate_size=replicate, dp_shard_size=shard, tp_size=tp, tp_handler=plan)
    return _loop(Accelerator(parallelism_config=config), steps, memory_run)


def accelerate_nd_run(kind: str, steps: int, memory_run: bool) -> tuple[float, float, float]:
    """The same N-D setup through Accelerate's own ``ParallelismConfig`` (``cpu=True``: gloo on 4 ranks)."""
    from accelerate import Accelerator
    from accelerate.parallelism_config import ParallelismConfig

    replicate, shard, tp = ND_SETUPS[kind]
    if (replicate, shard, tp) == (4, 1, 1):
        return _loop(Accelerator(cpu=True), steps, memory_run)
    try:
        config = ParallelismConfig(dp_replicate_size=replicate, dp_shard_size=shard, tp_size=tp)
        accelerator = Accelerator(cpu=True, parallelism_config=config)
        result = _loop(accelerator, steps, memory_run)
    except Exception as exc:  # on CPU: cpu=True is MULTI_CPU, which ParallelismConfig refuses (see nd_main)
        raise RuntimeError(f"not run: Accelerate raises {type(exc).__name__}: "
                           f"{str(exc).strip().splitlines()[0][:220]}") from exc
    mesh = getattr(accelerator, "torch_device_mesh", None)
    if str(accelerator.distributed_type) != "DistributedType.FSDP" and shard > 1:
        raise RuntimeError(f"not run: Accelerate ran {accelerator.distributed_type} (mesh {mesh}), not FSDP2")
    return result


def accelerate_run(kind: str, steps: int, memory_run: bool) -> tuple[float, float, float]:
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    if kind.startswith("zero"):
        return _accelerate_deepspeed_run(kind, steps, memory_run)
    plugin = None
    if kind == "fsdp2":
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                                transformer_cls_names_to_wrap=["Block"])
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    if plugin is not None and str(accelerator.distributed_type) != "DistributedType.FSDP":
        raise RuntimeError(f"not run: on CPU Accelerate ignores fsdp_plugin and runs {accelerator.distributed_type} "
                           "(plain DDP); without cpu=True each rank trains alone")
    return _loop(accelerator, steps, memory_run)


def _accelerate_deepspeed_run(kind: str, steps: int, memory_run: bool) -> tuple[Any, ...]:
    import torch.distributed as dist
    from accelerate import Accelerator, DeepSpeedPlugin

    # Not cpu=True: with it Accelerate drops the plugin and runs plain DDP (checked below all the same).
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=_ds_config(kind)))
    group = dist.get_world_size() if dist.is_initialized() else 1
    if str(accelerator.distributed_type) != "DistributedType.DEEPSPEED":
        raise RuntimeError(f"not run: Accelerate ignored deepspeed_plugin and runs {accelerator.distributed_type}")
    mismatch = (f"Accelerate counts {accelerator.num_processes} process(es) where DeepSpeed sees {group}"
                if accelerator.num_processes != group else "")
    try:
        result = _loop(accelerator, steps, memory_run)
    except Exception as exc:
        if mismatch:  # the known CPU failure: say what it is, not only DeepSpeed's last line
            raise RuntimeError(f"not run: {mismatch}; DeepSpeed then fails: {type(exc).__name__}: "
                               f"{str(exc).strip().splitlines()[0][:150]}") from exc
        raise
    return (*result, mismatch) if mismatch else result


def _measure(fn: Callable[..., tuple[float, float, float]], kind: str, steps: int, memory_run: bool = False,
             world_size: int = 2) -> Any:
    try:
        return run_on_ranks(fn, world_size=world_size, args=(kind, steps, memory_run), timeout=600)[0]
    except Exception as exc:  # a framework that cannot run this setup is reported, not fatal
        last = str(exc).strip().splitlines()[-1]
        return last[last.index("not run"):] if "not run:" in last else f"failed: {last[:300]}"


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
    parser.add_argument("--quick", action="store_true", help="one short repeat: checks the script works (not a measurement)")
    parser.add_argument("--nd", action="store_true", help="The N-D rows on 4 ranks instead.")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.steps = 1, 3
    if args.nd:
        nd_main(args.repeats, args.steps)
        return
    setups: dict[str, tuple[Callable[..., Any], str]] = {
        "hasten ddp": (hasten_run, "ddp"), "hasten fsdp2": (hasten_run, "fsdp2"),
        "hasten fsdp2 (no reshard)": (hasten_run, "fsdp2-keep"),
        "hasten fsdp2 (stock gloo comms)": (hasten_run, "fsdp2-stock")}
    has_deepspeed = importlib.util.find_spec("deepspeed") is not None  # not imported here: the ranks import it
    if has_deepspeed:
        setups.update({"hasten zero2": (hasten_run, "zero2"), "hasten zero3": (hasten_run, "zero3")})
    else:
        print("deepspeed is not installed: its rows are skipped")
    try:
        import accelerate  # noqa: F401

        setups.update({"accelerate ddp": (accelerate_run, "ddp"), "accelerate fsdp2": (accelerate_run, "fsdp2")})
        if has_deepspeed:
            setups.update({"accelerate zero2": (accelerate_run, "zero2"), "accelerate zero3": (accelerate_run, "zero3")})
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
    print(f"  {'setup':32s} {'ms/step':>8s} {'vs ddp':>7s} {'state MB':>9s} {'vs ddp':>7s} {'peak RSS MB':>12s}")
    for name, runs in results.items():
        if name not in ok:
            print(f"  {name:32s} {next(r for r in runs if isinstance(r, str))}")
            continue
        ms, state = (statistics.median(r[i] for r in runs) for i in range(2))
        peak = memory[name][2] if isinstance(memory[name], tuple) else float("nan")
        print(f"  {name:32s} {ms:8.2f} {ms / base:6.2f}x {state:9.1f} {state / base_state:6.2f}x {peak:12.1f}")
        if len(runs[0]) > 3:  # a setup that ran, but not as a consistent 2-process run of its library
            print(f"  {'':32s} ({runs[0][3]}: DeepSpeed trained on both ranks, Accelerate's own counts are wrong)")


def nd_main(repeats: int, steps: int) -> None:
    """The N-D rows: 4 ranks, step time and per-rank state vs DDP on 4 ranks, hasten beside Accelerate."""
    setups: dict[str, tuple[Callable[..., Any], str]] = {f"hasten {k}": (hasten_nd_run, k) for k in ND_SETUPS}
    if importlib.util.find_spec("accelerate") is not None:
        setups.update({f"accelerate {k}": (accelerate_nd_run, k) for k in ND_SETUPS})
    else:
        print("accelerate is not installed: its rows are skipped")
    results: dict[str, list[Any]] = {name: [] for name in setups}
    for _ in range(repeats):
        for name, (fn, kind) in setups.items():  # interleaved, so machine drift hits every setup alike
            results[name].append(_measure(fn, kind, steps, world_size=4))
    ok = {name: runs for name, runs in results.items() if all(isinstance(r, tuple) for r in runs)}
    base, base_state = (statistics.median(r[i] for r in ok["hasten ddp x4"]) for i in range(2))
    print(f"\n4 gloo ranks, {sum(p.numel() for p in Stack().parameters()) / 1e6:.1f}M parameters, AdamW, batch {BATCH} "
          f"per data-parallel rank, {steps} steps, median of {repeats} runs (rank 0). 'ideal' = DDP's state / "
          "(dp_shard x tp): the target is within 5%.")
    print(f"  {'setup':30s} {'ms/step':>8s} {'vs ddp':>7s} {'state MB':>9s} {'ideal MB':>9s} {'vs ideal':>9s}")
    for name, runs in results.items():
        if name not in ok:
            print(f"  {name:30s} {next(r for r in runs if isinstance(r, str))}")
            continue
        _, shard, tp = ND_SETUPS[setups[name][1]]
        ms, state = (statistics.median(r[i] for r in runs) for i in range(2))
        ideal = base_state / (shard * tp)
        print(f"  {name:30s} {ms:8.2f} {ms / base:6.2f}x {state:9.1f} {ideal:9.1f} {100 * (state / ideal - 1):+8.1f}%")


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        raise
