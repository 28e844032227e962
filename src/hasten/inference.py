"""Accelerate's ``accelerate.inference`` module path: pipeline-parallel inference on
``torch.distributed.pipelining`` (the PiPPy engine inside torch).

``prepare_pippy`` splits a model into one stage per process at ``split_points`` (module names, or
``"auto"``: balanced with ``generate_device_map``), traces it with the example inputs, and replaces its
``forward``: the first process feeds the batch in ``num_chunks`` micro-batches (GPipe schedule), the last
one returns the output (every process with ``gather_output=True``; the others get ``None``). It runs on
gloo as on NCCL.

Example:
    >>> model = prepare_pippy(model, example_args=(torch.randn(4, 16),))
    >>> output = model(batch)  # the output on the last process (None elsewhere)
"""

from __future__ import annotations

import math
from types import MethodType
from typing import Any

from torch import nn

from hasten._lazy import accelerate_path_getattr
from hasten.big_modeling import calculate_maximum_sizes, compute_module_sizes, infer_auto_device_map
from hasten.exceptions import ConfigurationError
from hasten.ops.collectives import pad_input_tensors
from hasten.ops.compat import copy_tensor_to_devices
from hasten.ops.tree import find_batch_size, send_to_device
from hasten.state import PartialState

__all__ = ["build_pipeline", "find_pippy_batch_size", "generate_device_map", "pippy_forward", "prepare_pippy"]


def generate_device_map(model: nn.Module, num_processes: int = 1, no_split_module_classes: list[str] | None = None,
                        max_memory: dict[Any, int | str] | None = None) -> dict[str, Any]:
    """Split ``model`` into ``num_processes`` consecutive, roughly equal parts: a device map onto 0..n-1.

    Example:
        >>> generate_device_map(nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]), num_processes=2)
        {'0': 0, '1': 0, '2': 1, '3': 1}
    """
    if num_processes < 1:
        raise ValueError(f"generate_device_map: num_processes={num_processes} must be at least 1")
    if max_memory is None:
        # Each device's budget is its share of the model plus room for the largest layer, which the
        # placement keeps free on every device, with 10% slack for shared tensors.
        total, (largest, _) = calculate_maximum_sizes(model)
        share = math.ceil((total / num_processes + largest) * 1.1)
        max_memory = {index: share for index in range(num_processes)}
    return infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split_module_classes,
                                 clean_result=False)


def find_pippy_batch_size(args: tuple[Any, ...] | None, kwargs: dict[str, Any] | None) -> int | None:
    """The batch size of the first tensor found in ``args``, then ``kwargs`` (``None`` without one)."""
    for value in (*(args or ()), *(kwargs or {}).values()):
        size = find_batch_size(value) if value is not None else None
        if size is not None:
            return size
    return None


def build_pipeline(model: nn.Module, split_points: list[str], args: tuple[Any, ...], kwargs: dict[str, Any] | None,
                   num_chunks: int) -> Any:
    """Split ``model`` before each of ``split_points`` (traced with the micro-batch inputs ``args`` /
    ``kwargs``) and return the GPipe schedule of this process's stage (stage ``process_index``)."""
    from torch.distributed.pipelining import ScheduleGPipe, SplitPoint, pipeline

    state = PartialState()
    if len(split_points) + 1 != state.num_processes:
        raise ConfigurationError(f"{len(split_points)} split points make {len(split_points) + 1} stages, but the "
                                 f"run has {state.num_processes} processes: give num_processes - 1 split points "
                                 "(or split_points='auto').")
    pipe = pipeline(model, mb_args=args, mb_kwargs=kwargs,
                    split_spec={point: SplitPoint.BEGINNING for point in split_points})
    stage = pipe.build_stage(state.process_index, device=state.device)
    return ScheduleGPipe(stage, num_chunks)


def pippy_forward(forward: Any, num_chunks: int, gather_output: bool, *args: Any, **kwargs: Any) -> Any:
    """Run one pipelined step: the first process feeds ``args``/``kwargs`` (the batch padded to a multiple
    of ``num_chunks``), the last returns the output; with ``gather_output`` every process gets it."""
    state = PartialState()
    output = None
    if state.num_processes == 1:
        output = forward(*args, **kwargs)
    elif state.is_main_process:
        batch_size = find_pippy_batch_size(args, kwargs)
        if batch_size is None:
            raise ValueError("Could not find batch size from args or kwargs")
        if batch_size != num_chunks:
            args = pad_input_tensors(args, batch_size, num_chunks)
            kwargs = pad_input_tensors(kwargs, batch_size, num_chunks)
        forward(*args, **kwargs)
    elif state.is_last_process:
        output = forward()
    else:
        forward()
    if gather_output:
        output = copy_tensor_to_devices(output)
    return output


def _auto_split_points(model: nn.Module, stages: int, no_split: list[str] | None) -> list[str]:
    """The first module of each stage after the first: from ``generate_device_map`` (Accelerate's rule);
    when that map leaves a stage empty (it keeps room for the largest layer on every device, which can
    leave the last devices unused on a small model), the top-level children are cut into ``stages``
    contiguous groups of about equal size instead."""
    device_map = generate_device_map(model, stages, no_split_module_classes=no_split)
    if set(device_map.values()) == set(range(stages)):
        return [next(name for name, device in device_map.items() if device == index) for index in range(1, stages)]
    children = [name for name, _ in model.named_children()]
    if len(children) < stages:
        raise ConfigurationError(f"split_points='auto' cannot cut a model with {len(children)} top-level modules "
                                 f"into {stages} stages; pass split_points=[...] with {stages - 1} module names.")
    sizes = compute_module_sizes(model)
    total = sum(sizes[name] for name in children)
    points: list[str] = []
    running = 0
    for position, name in enumerate(children):
        left_to_cut = stages - 1 - len(points)
        if position > 0 and left_to_cut and (running >= total * (len(points) + 1) / stages
                                             or len(children) - position == left_to_cut):
            points.append(name)
        running += sizes[name]
    return points


def prepare_pippy(model: nn.Module, split_points: str | list[str] | None = "auto",
                  no_split_module_classes: list[str] | None = None, example_args: tuple[Any, ...] | None = (),
                  example_kwargs: dict[str, Any] | None = None, num_chunks: int | None = None,
                  gather_output: bool | None = False) -> nn.Module:
    """Make ``model`` a pipeline over the processes: one stage each, split before ``split_points``.

    Args:
        model: the model (on the CPU or the meta device is not supported: real weights are needed).
        split_points: module names where a new stage begins (``num_processes - 1`` of them), or ``"auto"``
            for a balanced split (``generate_device_map``).
        no_split_module_classes: classes ``"auto"`` never splits inside.
        example_args: positional inputs of one micro-batch (batch size = the batch / ``num_chunks``).
        example_kwargs: keyword inputs of one micro-batch (the same keys at every call).
        num_chunks: micro-batches per batch (default: the number of processes).
        gather_output: send the last stage's output to every process.

    Returns:
        ``model``, whose ``forward`` now runs the pipeline (``pippy_stage`` holds the schedule,
        ``hf_split_points`` the split points).
    """
    state = PartialState()
    example_args = send_to_device(example_args, "cpu")
    example_kwargs = send_to_device(example_kwargs, "cpu")
    num_chunks = state.num_processes if num_chunks is None else num_chunks
    if split_points == "auto":
        split_points = _auto_split_points(model, state.num_processes, no_split_module_classes)
    points = [split_points] if isinstance(split_points, str) else list(split_points or [])
    schedule = build_pipeline(model, points, tuple(example_args or ()), example_kwargs, num_chunks)
    model._original_forward = model.forward  # type: ignore[assignment]
    model._original_call = model.__call__  # type: ignore[assignment]
    model.pippy_stage = schedule  # type: ignore[assignment]
    model.hf_split_points = points  # type: ignore[assignment]

    def forward(*args: Any, **kwargs: Any) -> Any:
        return pippy_forward(schedule.step, num_chunks, bool(gather_output), *args, **kwargs)

    forward.__wrapped__ = MethodType(forward, model)  # type: ignore[attr-defined]
    model.forward = forward  # type: ignore[method-assign]
    return model

# Names Accelerate's module at this path shows but defines elsewhere (hasten/_accelerate_shown.py).
__getattr__ = accelerate_path_getattr(__name__, globals())
