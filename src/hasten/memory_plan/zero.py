"""ZeRO-2 and ZeRO-3 plans: the model's own forward and backward on fake tensors, plus ZeRO's buffers by rule.

DeepSpeed's engine cannot run on fake tensors (it flattens real storages, reads flags with ``.item()`` and
allocates through its accelerator), so a ZeRO plan is made of two parts:

* what the model itself needs: forward and backward of the prepared module (DeepSpeed casts the whole
  module to bf16 under ``mixed_precision='bf16'``, without autocast) run on fake tensors inside torch's
  ``MemTracker``; its peak less the parameters and gradients of a plain backward is the activations and
  temporaries a ZeRO rank holds too (inputs included);
* what ZeRO holds, from DeepSpeed 0.19's allocations and the config's sizes (``reduce_bucket_size``,
  ``overlap_comm``, ``stage3_param_persistence_threshold``, ``stage3_max_live_parameters``,
  ``stage3_prefetch_bucket_size``; ``"auto"`` filled from ``model.config.hidden_size`` as hasten's
  DeepSpeed strategy fills it):

  - ZeRO-2: every parameter (flat buffer, parameter dtype), an fp32 master copy of this rank's partition
    and the optimizer's state of it; in backward one (two with ``overlap_comm``) reduce bucket of
    ``reduce_bucket_size`` elements and the fp32 gradient partition; at the step the fp32 gradient of the
    partition and the optimizer's temporaries.
  - ZeRO-3: this rank's partition of the parameters (plus the persistent ones, below the persistence
    threshold, whole), the gradient partition buffer and one reduce bucket (both allocated when the engine
    is built), the fp32 master partition when parameters are 16-bit; in forward and backward the gathered
    parameters (all of them when their reuse distance is under ``stage3_max_reuse_distance``, else up to
    ``stage3_max_live_parameters`` + ``stage3_prefetch_bucket_size`` elements) and the partition's fp32
    gradient.

The peak is the larger of the backward phase and the optimizer-step phase. ``benchmarks/bench_memory_plan.py``
measures these plans against DeepSpeed itself on gloo ranks (docs/will-it-fit.md has the figures).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hasten._private_api import memory_tracker
from hasten.memory_plan.inputs import PlanError, default_loss
from hasten.memory_plan.result import ProcessPlan, categorize

#: Optimizers a ZeRO plan knows: (fp32 state tensors per element, fp32 temporaries per element at the step,
#: the fp32 gradient of the partition included), as measured on DeepSpeed's flat partitions.
ZERO_OPTIMIZER_BUFFERS = {"adamw": (2, 3), "adam": (2, 3), "sgd": (0, 2), "sgd(momentum)": (1, 2)}

#: DeepSpeed 0.19's defaults for the sizes a ZeRO plan reads (``deepspeed/runtime/zero/config.py``).
DEEPSPEED_DEFAULTS = {"reduce_bucket_size": 500_000_000, "stage3_prefetch_bucket_size": 50_000_000,
                      "stage3_max_live_parameters": 1_000_000_000, "stage3_param_persistence_threshold": 100_000,
                      "stage3_max_reuse_distance": 1_000_000_000, "contiguous_gradients": True}


@dataclass(frozen=True)
class ZeroSettings:
    """The DeepSpeed sizes that decide ZeRO's buffers (elements, not bytes)."""

    stage: int
    reduce_bucket_size: int
    prefetch_bucket_size: int
    max_live_parameters: int
    persistence_threshold: int
    max_reuse_distance: int
    overlap_comm: bool
    contiguous_gradients: bool


def zero_settings(stage: int, config: Mapping[str, Any] | None, model: nn.Module) -> ZeroSettings:
    """The sizes of ``config`` (a DeepSpeed config dict, or its ``zero_optimization`` block), DeepSpeed's
    defaults where absent; ``"auto"`` from ``model.config.hidden_size`` as hasten's DeepSpeed strategy fills it.

    Raises:
        PlanError: a size that is neither a number nor ``"auto"``, or ``"auto"`` on a model without a hidden size.
    """
    block = dict(config or {})
    block = dict(block.get("zero_optimization", block))

    def size(key: str, auto_rule: Any) -> int:
        value = block.get(key, DEEPSPEED_DEFAULTS[key])
        if value == "auto":
            hidden = getattr(getattr(model, "config", None), "hidden_size", None)
            if hidden is None:
                raise PlanError(f"DeepSpeed config {key}='auto' is filled from model.config.hidden_size, which this "
                                "model has not: write a number in the config.")
            return int(auto_rule(int(hidden)))
        try:
            return int(float(value))
        except (TypeError, ValueError):
            raise PlanError(f"DeepSpeed config {key}={value!r} is not a number: write e.g. {key}=5e8.") from None

    overlap = block.get("overlap_comm")
    return ZeroSettings(stage=stage, reduce_bucket_size=size("reduce_bucket_size", lambda h: h * h),
                        prefetch_bucket_size=size("stage3_prefetch_bucket_size", lambda h: 0.9 * h * h),
                        max_live_parameters=size("stage3_max_live_parameters", lambda h: 1e9),
                        persistence_threshold=size("stage3_param_persistence_threshold", lambda h: 10 * h),
                        max_reuse_distance=size("stage3_max_reuse_distance", lambda h: 1e9),
                        overlap_comm=stage == 3 if overlap is None else bool(overlap),
                        contiguous_gradients=bool(block.get("contiguous_gradients", True)))


@dataclass(frozen=True)
class _ModelStep:
    """What the model needs in forward and backward, whatever ZeRO does (bytes)."""

    activations: int  # the plain backward's peak less its parameters and gradients (inputs included)
    forward_activations: int  # what the forward leaves alive for backward (inputs and outputs included)
    input_bytes: int  # the batch, alive through the optimizer step too
    parameter_numels: tuple[int, ...]
    element_size: int  # of the parameters as the engine holds them (2 under bf16, else 4)


def model_step(model: nn.Module, inputs: dict[str, torch.Tensor], mixed_precision: str, loss_fn: Any) -> _ModelStep:
    """Forward and backward of ``model`` as DeepSpeed runs it (bf16/fp16: the module cast, no autocast), on the
    fake tensors of the active fake mode, inside torch's tracker."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision)
    if dtype is not None:  # the engine casts the module; float inputs must be cast by the loop too
        for tensor in (*model.parameters(), *model.buffers()):  # in place: fake parameters cannot be swapped
            if tensor.is_floating_point():
                tensor.data = tensor.data.to(dtype)
        inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    numels = tuple(p.numel() for p in model.parameters() if p.requires_grad)
    tracker = memory_tracker()
    tracker.track_external(model, *inputs.values())
    with tracker:
        output = model(inputs["input"]) if list(inputs) == ["input"] else model(**inputs)
        loss = loss_fn(output, inputs) if loss_fn is not None else default_loss(output)
        after_forward = categorize(tracker.get_tracker_snapshot("current")[torch.device("cpu")])
        loss.backward()
    peak = categorize(tracker.get_tracker_snapshot("peak")[torch.device("cpu")])
    forward_activations = sum(after_forward.values()) - after_forward["parameters"]
    activations = max(forward_activations, sum(peak.values()) - peak["parameters"] - peak["gradients"])
    input_bytes = sum(t.numel() * t.element_size() for t in inputs.values())
    return _ModelStep(activations, forward_activations, input_bytes, numels, 4 if dtype is None else 2)


def zero_process_plan(step: _ModelStep, settings: ZeroSettings, world_size: int, optimizer: str) -> ProcessPlan:
    """Rank 0's plan under ZeRO ``settings.stage`` on ``world_size`` ranks (every rank's is the same)."""
    if optimizer not in ZERO_OPTIMIZER_BUFFERS:
        raise PlanError(f"a ZeRO plan knows the optimizers {', '.join(ZERO_OPTIMIZER_BUFFERS)}, not {optimizer!r}: "
                        "plan with one of them (their state per parameter decides ZeRO's optimizer memory).")
    states, step_temporaries = ZERO_OPTIMIZER_BUFFERS[optimizer]
    b = step.element_size
    total = sum(step.parameter_numels)
    partition = -(-total // world_size)  # this rank's elements (DeepSpeed pads partitions to equal size)
    fp32_partition = 4 * partition
    largest = max(step.parameter_numels, default=0)
    in_flight_grads = 2 * largest * b  # a parameter's gradient being copied into the bucket, and the next one
    buckets = settings.reduce_bucket_size * b if settings.contiguous_gradients else 0
    if settings.stage == 2:
        parameters = total * b
        gradients = fp32_partition  # the reduced gradients of the owned partition (fp32)
        optimizer_state = fp32_partition * (1 + states)  # fp32 master partition + the optimizer's state
        communication = buckets * (2 if settings.overlap_comm else 1)  # from backward until the step
        gathered = 0
    else:
        persistent = sum(n for n in step.parameter_numels if n <= settings.persistence_threshold)
        parameters = partition * b + persistent * b
        gradients = partition * b  # grad_partitions_flat_buffer, allocated with the engine
        optimizer_state = (0 if b == 4 else fp32_partition) + fp32_partition * states
        communication = buckets + 1  # the reduce bucket (and an inf/nan flag), allocated with the engine
        partitioned = total - persistent
        # From the second step on, a gathered parameter whose next use (forward -> backward) is nearer than
        # stage3_max_reuse_distance elements stays gathered: with the default (1e9) every parameter of a model
        # under ~500M of them. Farther ones are freed, leaving up to max_live + prefetch gathered.
        kept = 2 * partitioned <= settings.max_reuse_distance
        gathered = (partitioned if kept else min(partitioned, settings.max_live_parameters
                                                 + settings.prefetch_bucket_size)) * b
        in_flight_grads += fp32_partition  # the fp32 gradient of the partition, written as buckets reduce
    # ZeRO frees each gradient once bucketed, so the backward peaks either at its start (the plain backward's
    # activations and temporaries, before any parameter has a gradient: a large vocabulary's logits) or later,
    # with the forward's activations still alive and the partition's gradients being reduced.
    early = step.activations
    later = step.forward_activations + in_flight_grads + (gradients if settings.stage == 2 else 0)
    backward = dict(parameters=parameters + gathered,
                    gradients=(gradients if settings.stage == 3 else 0) + (later - step.forward_activations
                                                                           if later > early else 0),
                    optimizer_state=optimizer_state,
                    activations=step.forward_activations if later > early else early, temporaries=0,
                    communication=communication)
    optimizer_step = dict(parameters=parameters, gradients=gradients if settings.stage == 3 else 0,
                          optimizer_state=optimizer_state, activations=step.input_bytes,
                          temporaries=fp32_partition * step_temporaries,
                          communication=communication if settings.stage == 3 else 0)
    peak = max(backward, optimizer_step, key=lambda sums: sum(sums.values()))
    return ProcessPlan(rank=0, peak_bytes=sum(peak.values()), parameters=peak["parameters"],
                       gradients=peak["gradients"], optimizer_state=peak["optimizer_state"],
                       activations=peak["activations"], temporaries=peak["temporaries"],
                       communication=peak["communication"])
