"""Accelerate's ``accelerate.inference`` module path: pipeline-parallel inference on
``torch.distributed.pipelining`` (the PiPPy engine inside torch).

``prepare_pippy`` splits a model into one stage per process at ``split_points`` (module names, or
``"auto"``: balanced with ``generate_device_map``), traces it with one micro-batch of the example inputs (the example is the batch of one process, as
Accelerate documents it: its first ``ceil(batch / num_chunks)`` rows), and replaces its ``forward``: the
first process feeds the batch in ``num_chunks`` micro-batches (GPipe schedule), the last one returns the
output (every process with ``gather_output=True``; the others get ``None``). It runs on gloo as on NCCL.

The stages exchange activations in buffers of the traced micro-batch's shape, so each call first sends
the micro-batch's row count from the first process (one small broadcast); a batch whose micro-batches
have another row count (a smaller last batch, or an example that was one micro-batch already) is run on
a pipeline traced for that count, built once and kept.

Example:
    >>> model = prepare_pippy(model, example_args=(torch.randn(4, 16),))
    >>> output = model(batch)  # the output on the last process (None elsewhere)
"""

from __future__ import annotations

import math
from types import MethodType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hasten._lazy import accelerate_path_getattr
from hasten.big_modeling import calculate_maximum_sizes, compute_module_sizes, infer_auto_device_map
from hasten.exceptions import ConfigurationError
from hasten.ops.collectives import pad_input_tensors
from hasten.ops.compat import copy_tensor_to_devices
from hasten.ops.tree import find_batch_size, recursively_apply, send_to_device
from hasten.state import PartialState

__all__ = ["build_pipeline", "find_pippy_batch_size", "generate_device_map", "micro_batch_rows", "pippy_forward",
           "prepare_pippy"]


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
    for point in split_points:  # a second trace: undo the first one's split markers (they would nest)
        marked = _submodule_or_none(model, point)
        if marked is not None and "_orig_forward" in marked.__dict__:
            marked.forward = marked.__dict__.pop("_orig_forward")  # type: ignore[method-assign]
    pipe = pipeline(model, mb_args=args, mb_kwargs=kwargs,
                    split_spec={point: SplitPoint.BEGINNING for point in split_points})
    stage = pipe.build_stage(state.process_index, device=state.device)
    return ScheduleGPipe(stage, num_chunks)


def _submodule_or_none(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


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


def micro_batch_rows(batch_size: int, num_chunks: int) -> int:
    """Rows of one micro-batch when ``batch_size`` rows are padded to a multiple of ``num_chunks`` and split."""
    return -(-batch_size // num_chunks)


def _with_rows(data: Any, batch_size: int, rows: int) -> Any:
    """``data`` with every tensor whose first dimension is ``batch_size`` cut or repeated to ``rows`` rows
    (an input of the right shape for tracing; its values do not matter)."""
    def resize(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 0 or tensor.shape[0] != batch_size or rows == batch_size:
            return tensor
        return tensor[torch.arange(rows) % batch_size]

    return recursively_apply(resize, data)


class _TracedPipelines:
    """The pipeline of this process's stage traced for each micro-batch row count met so far."""

    def __init__(self, model: nn.Module, points: list[str], args: tuple[Any, ...], kwargs: dict[str, Any] | None,
                 num_chunks: int) -> None:
        self.model, self.points, self.num_chunks = model, points, num_chunks
        self.args, self.kwargs = args, kwargs
        self.example_rows = find_pippy_batch_size(args, kwargs)
        self.schedules: dict[int | None, Any] = {}
        #: The pipelined forward ``prepare_pippy`` put on the model (swapped out while tracing).
        self.pipelined_forward: Any = None

    def traced_rows(self) -> int | None:
        """The micro-batch rows the example gives: its first ``ceil(rows / num_chunks)`` rows."""
        return None if self.example_rows is None else micro_batch_rows(self.example_rows, self.num_chunks)

    def schedule(self, rows: int | None) -> Any:
        """The schedule traced with micro-batches of ``rows`` rows (built on first use; every process
        asks for the same ``rows`` at the same call)."""
        if rows not in self.schedules:
            args, kwargs = self.args, self.kwargs
            if rows is not None and self.example_rows is not None:
                args = _with_rows(args, self.example_rows, rows)
                kwargs = _with_rows(kwargs, self.example_rows, rows)
            # Trace the model's own forward, not the pipelined one prepare_pippy put in its place.
            pipelined = self.pipelined_forward
            if pipelined is not None:
                self.model.forward = self.model._original_forward  # type: ignore[method-assign,assignment]
            try:
                self.schedules[rows] = build_pipeline(self.model, self.points, args, kwargs, self.num_chunks)
            finally:
                if pipelined is not None:
                    self.model.forward = pipelined  # type: ignore[method-assign]
        return self.schedules[rows]


def _agreed_rows(traced: int | None, num_chunks: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The micro-batch rows of this call, as the first process (the one that feeds the batch) sees them,
    on every process: one broadcast of one integer."""
    state = PartialState()
    if state.num_processes == 1 or traced is None:
        return traced
    count = torch.zeros(1, dtype=torch.int64, device=state.device)
    if state.is_main_process:
        batch_size = find_pippy_batch_size(args, kwargs)
        if batch_size is None:
            raise ValueError("Could not find batch size from args or kwargs")
        count[0] = micro_batch_rows(batch_size, num_chunks)
    dist.broadcast(count, src=0)
    return int(count.item())


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
        example_args: positional inputs of one process's batch (Accelerate's meaning); the pipeline is
            traced with its first ``ceil(batch / num_chunks)`` rows. An example that is one micro-batch
            already works too: the first call then traces once more for its real micro-batch size.
        example_kwargs: keyword inputs, like ``example_args`` (the same keys at every call).
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
    pipelines = _TracedPipelines(model, points, tuple(example_args or ()), example_kwargs, num_chunks)
    schedule = pipelines.schedule(pipelines.traced_rows())
    model._original_forward = model.forward  # type: ignore[assignment]
    model._original_call = model.__call__  # type: ignore[assignment]
    model.pippy_stage = schedule  # type: ignore[assignment]
    model.hf_split_points = points  # type: ignore[assignment]

    def forward(*args: Any, **kwargs: Any) -> Any:
        current = pipelines.schedule(_agreed_rows(pipelines.traced_rows(), num_chunks, args, kwargs))
        model.pippy_stage = current  # type: ignore[assignment]
        return pippy_forward(current.step, num_chunks, bool(gather_output), *args, **kwargs)

    forward.__wrapped__ = MethodType(forward, model)  # type: ignore[attr-defined]
    model.forward = forward  # type: ignore[method-assign]
    pipelines.pipelined_forward = forward
    return model

# Names Accelerate's module at this path shows but defines elsewhere (hasten/_accelerate_shown.py).
__getattr__ = accelerate_path_getattr(__name__, globals())
