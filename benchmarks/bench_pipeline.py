"""Pipeline schedules on gloo: step time and measured bubble vs the theoretical, hasten vs torch by hand.

Each stage is a chain of fixed-cost layers: a ``Linear(16, 16)`` whose forward holds its process for
``--forward-ms`` and whose backward for twice that (a sleep, so the figures do not depend on how busy
the machine's cores are). A process's busy time is the time its layers spent in that cost; its idle
fraction is ``1 - busy / step time``, and the measured bubble is the mean over processes. The
theoretical bubble is ``(p - 1) / (v * m + p - 1)`` for ``p`` processes, ``m`` micro-batches and ``v``
stages per process (``v = 1``: GPipe, 1F1B), the ideal step ``(v * m + p - 1)`` stage slots of forward and
backward. The whole model's cost is the same for every schedule (the stages of a multi-stage schedule
are shorter), so step times compare across schedules.

The peer in the same invocation is the same schedule written by hand on ``torch.distributed.pipelining``
(``PipelineStage`` over slices of the same ``nn.Sequential``, the schedule class with an MSE loss) on
the same forked gloo ranks. Accelerate has no pipeline-parallel training (its ``prepare_pippy`` runs
inference only), so it is not a peer here.

``--memory`` compares, per stage (GPipe and 1F1B, wider layers), the memory a training step adds to a
process (its peak RSS over its RSS after ``prepare``) with ``hasten.plan_memory`` of that stage as a
model of its own on one micro-batch (its planned peak over its parameters). The plan has no pipeline
layout, so what a pipeline adds (micro-batches in flight, send/receive buffers) is outside it and the
ratio shows how much that is; RSS also keeps what the allocator does not hand back.

Each (schedule, p) case runs ``--steps`` steps after one warm-up step, in ``--repeats`` separate runs;
figures are medians.

    .venv/bin/python benchmarks/bench_pipeline.py --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
MULTI = {"Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"}
WIDTH, LAYERS_PER_PROCESS, ROWS_PER_MICROBATCH = 16, 4, 2


class _Cost(torch.autograd.Function):
    """Holds the process for a fixed time in forward and twice that in backward, and counts it as busy."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:  # type: ignore[override]
        ctx.seconds = seconds
        _busy(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        _busy(2 * ctx.seconds)
        return grad, None


BUSY = [0.0]


def _busy(seconds: float) -> None:
    started = time.perf_counter()
    time.sleep(seconds)
    BUSY[0] += time.perf_counter() - started


class FixedCostLayer(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Cost.apply(torch.tanh(self.linear(x)), self.seconds)  # type: ignore[no-any-return]


def build(processes: int, forward_ms: float) -> nn.Sequential:
    torch.manual_seed(0)
    layers = processes * LAYERS_PER_PROCESS
    return nn.Sequential(*(FixedCostLayer(forward_ms / 1000 / LAYERS_PER_PROCESS) for _ in range(layers)))


def stage_count(schedule: str, processes: int) -> int:
    return processes * (2 if schedule in MULTI else 1)


def split_points(schedule: str, processes: int) -> list[str]:
    stages, layers = stage_count(schedule, processes), processes * LAYERS_PER_PROCESS
    return [str(layers * i // stages) for i in range(1, stages)]


def _batches(steps: int, microbatches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    rows = ROWS_PER_MICROBATCH * microbatches
    return [(torch.randn(rows, WIDTH, generator=generator), torch.randn(rows, WIDTH, generator=generator))
            for _ in range(steps)]


def _timed(run_step: Any, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
    """Median step time (barrier to barrier) and this process's median busy fraction (the first batch
    warms up)."""
    import torch.distributed as dist

    times, busy = [], []
    for index, (x, y) in enumerate(batches):
        dist.barrier()
        BUSY[0] = 0.0
        started = time.perf_counter()
        run_step(x, y)
        dist.barrier()  # the step ends when its slowest process is done (torch's last stage leaves early)
        elapsed = time.perf_counter() - started
        if index:
            times.append(elapsed)
            busy.append(BUSY[0] / elapsed)
    return statistics.median(times), statistics.median(busy)


def hasten_case(schedule: str, microbatches: int, steps: int, forward_ms: float) -> tuple[float, float]:
    from hasten import Accelerator, ParallelismConfig
    from hasten.state import PartialState, reset_state

    reset_state()
    processes = PartialState().num_processes
    config = ParallelismConfig(pp_size=processes, pp_schedule=schedule, pp_microbatches=microbatches,
                               pp_split_points=split_points(schedule, processes))
    accelerator = Accelerator(parallelism_config=config, cpu=True)
    model = build(processes, forward_ms)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer, loss_fn=F.mse_loss)

    def run_step(x: torch.Tensor, y: torch.Tensor) -> None:
        accelerator.backward(model(x, labels=y))
        optimizer.step()
        optimizer.zero_grad()

    return _timed(run_step, _batches(steps + 1, microbatches))


def torch_case(schedule: str, microbatches: int, steps: int, forward_ms: float) -> tuple[float, float]:
    """The same schedule by hand: stages are slices of the same Sequential, placed as torch's schedule wants."""
    import torch.distributed as dist
    from torch.distributed import pipelining
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    processes, rank = dist.get_world_size(), dist.get_rank()
    model = build(processes, forward_ms)
    stages = stage_count(schedule, processes)
    style = "v" if schedule in ("ZBVZeroBubble", "DualPipeV") else "loop"
    owners = generate_stage_to_rank_mapping(processes, stages, style=style)
    bounds = [0, *(int(point) for point in split_points(schedule, processes)), len(model)]
    mine = [pipelining.PipelineStage(model[bounds[stage]:bounds[stage + 1]], stage, stages, torch.device("cpu"))
            for stage in range(stages) if owners[stage] == rank]
    parameters = [p for stage in mine for p in stage.submod.parameters()]
    optimizer = torch.optim.SGD(parameters, lr=0.01)
    schedule_class = getattr(pipelining, f"Schedule{schedule}")
    runner = schedule_class(mine if schedule in MULTI else mine[0], n_microbatches=microbatches, loss_fn=F.mse_loss)
    first, last = owners[0] == rank, owners[stages - 1] == rank

    def run_step(x: torch.Tensor, y: torch.Tensor) -> None:
        runner.step(*((x,) if first else ()), target=y if last else None)
        optimizer.step()
        optimizer.zero_grad()

    return _timed(run_step, _batches(steps + 1, microbatches))


def runnable(schedule: str, processes: int, microbatches: int) -> bool:
    """DualPipeV needs a micro-batch per stage (hasten refuses fewer at prepare)."""
    return schedule != "DualPipeV" or microbatches >= 2 * processes


def every_case(microbatches: int, steps: int, forward_ms: float) -> dict[str, dict[str, tuple[float, float]]]:
    import torch.distributed as dist

    return {schedule: {"hasten": hasten_case(schedule, microbatches, steps, forward_ms),
                       "torch": torch_case(schedule, microbatches, steps, forward_ms)}
            for schedule in SCHEDULES if runnable(schedule, dist.get_world_size(), microbatches)}


def theoretical_bubble(schedule: str, processes: int, microbatches: int) -> float:
    per_process = 2 if schedule in MULTI else 1
    return (processes - 1) / (per_process * microbatches + processes - 1)


# ------------------------------------------------------------------------------------------------ memory
MEMORY_WIDTH, MEMORY_ROWS = 1024, 256


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def memory_case(schedule: str, microbatches: int) -> tuple[int, int]:
    """(stage index, this process's memory growth over two steps in bytes: the peak RSS over the RSS after
    ``prepare``, so the stage's parameters are already there and the rest is what a step adds)."""
    global WIDTH
    from hasten import Accelerator, ParallelismConfig
    from hasten.state import PartialState, reset_state

    reset_state()
    WIDTH = MEMORY_WIDTH
    processes = PartialState().num_processes
    config = ParallelismConfig(pp_size=processes, pp_schedule=schedule, pp_microbatches=microbatches,
                               pp_split_points=split_points(schedule, processes))
    accelerator = Accelerator(parallelism_config=config, cpu=True)
    model = build(processes, 0.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer, loss_fn=F.mse_loss)
    generator = torch.Generator().manual_seed(1)
    rows = MEMORY_ROWS * microbatches
    x, y = torch.randn(rows, WIDTH, generator=generator), torch.randn(rows, WIDTH, generator=generator)
    baseline = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as refs:  # the high-water mark starts again from here
        refs.write("5")
    for _ in range(2):
        accelerator.backward(model(x, labels=y))
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    return int(accelerator.torch_device_mesh.get_local_rank("pp")), (_status_kib("VmHWM") - baseline) * 1024


def planned_growth(schedule: str, processes: int, stage: int) -> int:
    """hasten.plan_memory of the stage as a model of its own, on one micro-batch: its planned peak over its
    parameters (gradients, optimizer state, activations and temporaries at the peak). The plan has no
    pipeline layout: the micro-batches in flight, the stage's send and receive buffers and the chunked
    batch are not in it."""
    global WIDTH
    from hasten import plan_memory
    from hasten.strategies.pipeline_schedules import cut_stages

    WIDTH = MEMORY_WIDTH

    def stage_model() -> nn.Module:
        model = build(processes, 0.0)
        cut_stages(model, split_points(schedule, processes), [stage], processes)
        return model

    plan = plan_memory(stage_model, batch=torch.zeros(MEMORY_ROWS, WIDTH), optimizer="sgd", momentum=0.9,
                       device_type="cpu").per_process[0]
    return plan.peak_bytes - plan.parameters


def memory_report(processes: int, microbatches: int) -> None:
    from hasten.testing import run_on_ranks

    print(f"\nmemory: p={processes} m={microbatches}, {processes * LAYERS_PER_PROCESS} x Linear({MEMORY_WIDTH}, "
          f"{MEMORY_WIDTH}), {MEMORY_ROWS} rows per micro-batch, SGD with momentum; growth of a step over prepare")
    print(f"{'schedule':<8} {'stage':>5} {'measured MB':>12} {'planned MB':>11} {'ratio':>6}")
    for schedule in ("GPipe", "1F1B"):
        for stage, measured in sorted(run_on_ranks(memory_case, world_size=processes, args=(schedule, microbatches),
                                                   timeout=600, pg_timeout=120)):
            planned = planned_growth(schedule, processes, stage)
            print(f"{schedule:<8} {stage:>5} {measured / 1e6:>12.1f} {planned / 1e6:>11.1f} {measured / planned:>6.2f}",
                  flush=True)


def main() -> None:
    from hasten.testing import run_on_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--forward-ms", type=float, default=20.0, help="forward cost of one process's layers")
    parser.add_argument("--schedules", nargs="+", default=SCHEDULES, choices=SCHEDULES)
    parser.add_argument("--memory", action="store_true", help="only the per-stage memory, measured vs planned")
    args = parser.parse_args()
    SCHEDULES[:] = args.schedules
    if args.memory:
        for processes in args.processes:
            memory_report(processes, max(args.microbatches))
        return
    print(f"{'p':>2} {'m':>2} {'schedule':<22} {'hasten s':>9} {'torch s':>8} {'ratio':>6} {'bubble':>7} "
          f"{'torch':>6} {'theory':>7}")
    for processes in args.processes:
        for microbatches in args.microbatches:
            if microbatches < processes:
                continue
            runs = [run_on_ranks(every_case, world_size=processes, args=(microbatches, args.steps, args.forward_ms),
                                 timeout=600, pg_timeout=120) for _ in range(args.repeats)]
            for schedule in SCHEDULES:
                if not runnable(schedule, processes, microbatches):
                    continue
                figures = {}
                for peer in ("hasten", "torch"):
                    step = statistics.median(run[0][schedule][peer][0] for run in runs)
                    bubble = statistics.median(1 - statistics.mean(rank[schedule][peer][1] for rank in run)
                                               for run in runs)
                    figures[peer] = (step, bubble)
                print(f"{processes:>2} {microbatches:>2} {schedule:<22} {figures['hasten'][0]:>9.3f} "
                      f"{figures['torch'][0]:>8.3f} {figures['hasten'][0] / figures['torch'][0]:>6.2f} "
                      f"{figures['hasten'][1]:>7.1%} {figures['torch'][1]:>6.1%} "
                      f"{theoretical_bubble(schedule, processes, microbatches):>7.1%}", flush=True)


if __name__ == "__main__":
    main()
