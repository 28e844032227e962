"""The ground truth of a plan: the same step run for real through ``Accelerator``, measured by torch's tracker.

Used by the tests and ``benchmarks/memory_plan.py`` on real (gloo) process groups: every tensor is real and
torch's ``MemTracker``/``FSDPMemTracker`` record each storage as it is allocated and freed, in the same
categories as the plan.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hasten._private_api import memory_tracker
from hasten.memory_plan.inputs import default_loss
from hasten.memory_plan.planner import PLANNED_STEPS
from hasten.memory_plan.result import ProcessPlan, categorize


def measure_step_memory(accelerator: Any, model: nn.Module, make_optimizer: Callable[[Any], torch.optim.Optimizer],
                        inputs: dict[str, torch.Tensor], loss_fn: Any = None) -> ProcessPlan:
    """Prepare ``model`` with ``accelerator``, run :data:`PLANNED_STEPS` real steps (each of the accelerator's
    ``gradient_accumulation_steps`` micro-batches, under ``accelerator.accumulate``); this process's measured peak.

    Under FSDP2 the model is prepared first and then tracked (``FSDPMemTracker`` needs the sharded model);
    otherwise the tracker is entered before ``prepare``, so DDP's buckets, which its reducer allocates when
    the model is wrapped, are counted.
    """
    optimizer = make_optimizer(model.parameters())
    sharded = accelerator.state.fsdp_plugin is not None
    if sharded:
        model, optimizer = accelerator.prepare(model, optimizer)
        tracker = memory_tracker(model, optimizer.optimizer)
        tracker.track_inputs(tuple(inputs.values()))
    else:
        tracker = memory_tracker()
        tracker.track_external(model, optimizer, *inputs.values())
    with tracker:
        if not sharded:
            model, optimizer = accelerator.prepare(model, optimizer)
        for _ in range(PLANNED_STEPS * accelerator.gradient_accumulation_steps):
            with accelerator.accumulate(model):  # one micro-batch; the prepared optimizer steps on the last
                output = model(inputs["input"]) if list(inputs) == ["input"] else model(**inputs)
                loss = loss_fn(output, inputs) if loss_fn is not None else default_loss(output)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            tracker.reset_mod_stats()  # the trackers keep one forward's module stats; the peak stays
    sums = categorize(tracker.get_tracker_snapshot("peak")[torch.device("cpu")])
    return ProcessPlan(rank=accelerator.process_index, peak_bytes=sum(sums.values()), **sums, largest_modules=())
