"""Which pipeline stages a process holds, the module each stage runs, and the schedule over them.

GPipe and 1F1B run one stage per process. Interleaved1F1B, LoopedBFS and InterleavedZeroBubble run
``k`` stages per process placed round-robin (process ``r`` holds stages ``r, r + P, r + 2P, ...``);
ZBVZeroBubble and DualPipeV run exactly two, placed in a V (process ``r`` holds ``r`` and
``2P - 1 - r``, so process 0 holds the first and the last stage). The placement is torch's own
(``generate_stage_to_rank_mapping``), which the schedules assume.

With several stages per process, the process's model holds the modules of all its stages (the others
are :class:`~hasten.strategies.pipeline_split.SkippedModule`), and each stage runs a *view* of it: a
copy of the shared containers whose children are that stage's modules (the same module objects, so
the parameters and the optimizer's references are shared) and no-ops for the rest.

Whether torch's schedule can run a combination (micro-batches, stages, placement) is decided before
any communication: :func:`check_schedule` builds the schedule's plan for every process, as each
process would at its first step, and turns torch's refusal into one :class:`ConfigurationError`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from hasten.config.parallelism import PP_MULTI_STAGE, PP_SCHEDULES
from hasten.exceptions import ConfigurationError
from hasten.strategies.pipeline_split import SkippedModule, stage_units


def stage_ranks(schedule: str, processes: int, num_stages: int) -> dict[int, int]:
    """Each stage's process (its rank in the pipeline group) under ``schedule``'s placement."""
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    return dict(generate_stage_to_rank_mapping(processes, num_stages, style=PP_MULTI_STAGE.get(schedule, "loop")))


def local_stages(schedule: str, processes: int, num_stages: int, rank: int) -> list[int]:
    """The stages process ``rank`` holds, in pipeline order."""
    return [stage for stage, owner in sorted(stage_ranks(schedule, processes, num_stages).items()) if owner == rank]


def check_schedule(schedule: str, processes: int, num_stages: int, microbatches: int) -> None:
    """Refuse a combination torch's ``schedule`` cannot run, before any process communicates.

    Builds the schedule on stand-in stages (no process group needed); torch plans every process's actions
    in it, so the refusal is the same on every process and arrives at ``prepare``.

    Raises:
        ConfigurationError: the stages do not divide over the processes as the schedule needs, or
            torch's schedule refuses (or cannot plan) this number of micro-batches.
    """
    multi, points = schedule in PP_MULTI_STAGE, num_stages - 1
    if not multi and num_stages != processes:
        raise ConfigurationError(
            f"pp_schedule={schedule!r} runs one stage per process: pp_size={processes} needs {processes - 1} split "
            f"points, got {points}. For several stages per process use one of {sorted(PP_MULTI_STAGE)}.")
    if PP_MULTI_STAGE.get(schedule) == "v" and num_stages != 2 * processes:
        raise ConfigurationError(
            f"pp_schedule={schedule!r} places exactly two stages per process (in a V): pp_size={processes} needs "
            f"{2 * processes - 1} split points, got {points}.")
    if num_stages % processes:
        raise ConfigurationError(
            f"{points} pp split points make {num_stages} stages, which do not divide evenly over pp_size={processes} "
            f"processes: give pp_size * k - 1 split points for k stages per process (e.g. {2 * processes - 1}).")
    if microbatches < processes:
        raise ConfigurationError(f"pp_microbatches={microbatches} is fewer than pp_size={processes}: every process "
                                 f"needs a micro-batch in flight. Use pp_microbatches >= {processes}.")
    if not multi:
        return
    from torch.distributed import pipelining

    schedule_class = getattr(pipelining, PP_SCHEDULES[schedule])
    # The schedule plans every process's actions (and checks them together) whichever process builds it.
    stages = [_PlanningStage(stage, num_stages, 0, processes) for stage in local_stages(schedule, processes, num_stages, 0)]
    try:
        schedule_class(stages, n_microbatches=microbatches, loss_fn=_no_loss, scale_grads=False)
    except (ValueError, RuntimeError, AssertionError, KeyError, IndexError) as error:
        raise ConfigurationError(
            f"pp_schedule={schedule!r} cannot run pp_microbatches={microbatches} over {num_stages} stages on "
            f"pp_size={processes} processes: torch's schedule refuses it ({type(error).__name__}: {error}). "
            f"{_microbatch_hint(schedule, processes, num_stages)}") from error


def _microbatch_hint(schedule: str, processes: int, num_stages: int) -> str:
    if schedule == "DualPipeV":
        return f"DualPipeV needs pp_microbatches >= {num_stages} (the number of stages)."
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        return (f"Use a multiple of pp_size={processes} micro-batches (they run in rounds of {processes}), "
                f"e.g. {processes} or {2 * processes}.")
    return f"Try pp_microbatches = {2 * processes}."


def _no_loss(output: Any, target: Any) -> torch.Tensor:  # pragma: no cover - a stand-in never called
    raise AssertionError("the planning schedule never runs")


class _PlanningStage:
    """What a torch schedule reads from its stages while it plans (no module, no process group)."""

    def __init__(self, stage_index: int, num_stages: int, rank: int, processes: int) -> None:
        self.stage_index, self.num_stages = stage_index, num_stages
        self.group_rank, self.group_size = rank, processes
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.submod = nn.Module()
        self.stage_index_to_group_rank: dict[int, int] = {}


# ----------------------------------------------------------------------------------- the stages' modules
def cut_stages(model: nn.Module, split_points: list[str], kept: list[int], num_stages: int) -> dict[int, nn.Module]:
    """Make ``model`` (in place) hold only the modules of stages ``kept``; return each kept stage's view.

    Returns:
        ``{stage: module}``: a module that runs only that stage's modules (names as in the full model),
        sharing ``model``'s modules and parameters.
    """
    return stage_views(model, stage_units(model, split_points, num_stages), kept)


def stage_views(model: nn.Module, units: list[tuple[str, int]], kept: list[int]) -> dict[int, nn.Module]:
    """Skip (in place) the ``units`` of stages not in ``kept``; return a view of ``model`` per kept stage.

    Args:
        model: the full model.
        units: ``(module name, stage)`` pairs in model order; modules that are neither a unit nor an
            ancestor of one (a transformers model's rotary embedding) are shared by every view.
        kept: the stages this process holds.
    """
    for name, stage in units:
        if stage not in kept:
            _replace(model, name, SkippedModule(name))
    containers = {name.rpartition(".")[0] for name, _ in units}
    ancestors = {".".join(part.split(".")[:i]) for part in containers for i in range(part.count(".") + 2)} | {""}
    owner = dict(units)
    return {stage: _view(model, "", ancestors, owner, stage) for stage in kept}


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    model.get_submodule(parent).register_module(child, module)


def _view(module: nn.Module, prefix: str, ancestors: set[str], owner: dict[str, int], stage: int) -> nn.Module:
    """A shallow copy of the container ``module`` whose children are ``stage``'s modules or no-ops."""
    view = copy.copy(module)
    view._modules = {}  # the copy shares everything but its children
    for child_name, child in module._modules.items():
        name = f"{prefix}{child_name}"
        if name in ancestors and name not in owner:
            view._modules[child_name] = _view(child, f"{name}.", ancestors, owner, stage)  # type: ignore[arg-type]
        elif name not in owner or owner[name] == stage:  # this stage's unit, or a module every stage shares
            view._modules[child_name] = child
        else:
            view._modules[child_name] = SkippedModule(name)
    return view


class StageCall(nn.Module):
    """One stage's module as torch's stage calls it: the inputs it should see, and no others.

    torch hands the step's keyword arguments to every stage; the model's own inputs belong to the first
    stage, and the labels (for a model that computes its own loss) to the last.

    Args:
        module: the stage's module (a view of the process's model).
        first: this is the pipeline's first stage.
        last_kwargs: on the last stage, the keyword arguments its forward gets (``None``: not the last).
    """

    def __init__(self, module: nn.Module, first: bool, last_kwargs: Callable[[dict[str, Any]], dict[str, Any]] | None):
        super().__init__()
        self.module = module
        self.first = first
        self.last_kwargs = last_kwargs

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        step_kwargs = {key: value for key, value in kwargs.items() if key != "labels"} if self.first else {}
        if self.last_kwargs is not None:
            step_kwargs.update(self.last_kwargs(kwargs))
        return self.module(*args, **step_kwargs)


def forward_only_schedule(schedule: str, stages: list[Any], owners: Mapping[int, int], microbatches: int) -> Any:
    """A forward-only schedule (evaluation) over this process's ``stages``, placed as ``schedule`` places them.

    Loop-placed schedules run forward only when built without a loss. torch's V-placed schedules
    (ZBVZeroBubble, DualPipeV) do not: their plans hold backward steps, and without a loss a process waits
    forever for gradients. For them the plan is GPipe's on the V placement: every process runs each of its
    stages over all micro-batches, in pipeline order (torch's runtime adds the sends and receives).
    """
    from torch.distributed import pipelining
    from torch.distributed.pipelining.schedules import _Action, _ComputationType, _PipelineScheduleRuntime

    # scale_grads=False: the plans' gradient step would otherwise divide gradients held from training.
    if PP_MULTI_STAGE[schedule] != "v":
        return getattr(pipelining, PP_SCHEDULES[schedule])(stages, n_microbatches=microbatches, loss_fn=None,
                                                           scale_grads=False)
    runtime = _PipelineScheduleRuntime(stages, n_microbatches=microbatches, loss_fn=None, scale_grads=False)
    plan: dict[int, list[_Action | None]] = {rank: [] for rank in sorted(set(owners.values()))}
    for stage in sorted(owners):
        plan[owners[stage]] += [_Action(stage, _ComputationType.FORWARD, micro) for micro in range(microbatches)]
    # torch checks that a plan holds a backward per micro-batch, then lowers it (adds the sends and receives);
    # the backward steps are dropped afterwards (run without a loss, torch's hand-off between two stages of
    # one process fails on them).
    for stage in sorted(owners, reverse=True):
        plan[owners[stage]] += [_Action(stage, _ComputationType.FULL_BACKWARD, micro) for micro in range(microbatches)]
    runtime._prepare_schedule_with_comms(plan)  # noqa: SLF001 - torch's way to run a given plan
    backward = {_ComputationType.FULL_BACKWARD, _ComputationType.SEND_B, _ComputationType.RECV_B,
                _ComputationType.REDUCE_GRAD}
    runtime.pipeline_order_with_comms = {rank: [action for action in actions if action.computation_type not in backward]
                                         for rank, actions in runtime.pipeline_order_with_comms.items()}
    return runtime


def call_shapes(data: Any) -> tuple[Any, ...]:
    """The shapes and dtypes of the tensors in ``data`` (a dict's in key order), to tell schedules apart."""
    if isinstance(data, torch.Tensor):
        return ((tuple(data.shape), data.dtype),)
    if isinstance(data, dict):
        return tuple(item for key in data for item in ((key,), *call_shapes(data[key])))
    if isinstance(data, (list, tuple)):
        return tuple(item for value in data for item in call_shapes(value))
    return ()


def takes_num_items(loss_fn: Callable[..., Any]) -> bool:
    """``loss_fn`` accepts ``num_items_in_batch=`` (by name or through ``**kwargs``)."""
    import inspect

    try:
        parameters = inspect.signature(loss_fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: let the call decide
        return True
    return any(p.name == "num_items_in_batch" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def own_loss(output: Any) -> torch.Tensor:
    """The model's own loss from its output: the tensor itself, ``output.loss`` or ``output["loss"]``."""
    if isinstance(output, torch.Tensor):
        return output
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if loss is None:
        raise ConfigurationError(f"The model returned {type(output).__name__} without a loss: pass prepare(..., "
                                 "loss_fn=fn) with fn(output, labels) -> loss, or return a loss when given labels.")
    return loss  # type: ignore[no-any-return]


def check_divisible(batch_size: int, microbatches: int) -> None:
    """Refuse a batch that does not split into ``microbatches`` equal micro-batches."""
    if batch_size % microbatches:
        raise ConfigurationError(
            f"A batch of {batch_size} rows does not split into pp_microbatches={microbatches} equal micro-batches: use "
            f"a batch size divisible by {microbatches} (drop_last=True keeps the last batch full), or change "
            "pp_microbatches. Unequal micro-batches would weight their rows unequally in the mean loss.")


__all__ = ["StageCall", "call_shapes", "check_divisible", "check_schedule", "cut_stages", "forward_only_schedule",
           "local_stages", "own_loss", "stage_ranks", "stage_views", "takes_num_items"]
