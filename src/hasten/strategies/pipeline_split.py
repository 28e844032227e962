"""Cutting a model into pipeline stages by module names, keeping every parameter's name.

A stage is the whole model with the modules of the other stages replaced by :class:`SkippedModule`, a
no-op that hands its first argument through. Nothing is renumbered or re-rooted: the stage's
``state_dict`` keys are the full model's keys of the modules it holds, so checkpoints and optimizers
see the full model's names.

The model's forward is run whole on every stage, so it must carry one tensor through its modules:
each stage's output becomes the next stage's first argument. Work the forward does outside the
modules (a functional activation, a residual add at the top level) would run on every stage; put it
in modules (``nn.Sequential`` models are always fine).

Example:
    >>> stage = cut_stage(nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]), ["2"], stage_index=1)
    >>> sorted(stage.state_dict())
    ['2.bias', '2.weight', '3.bias', '3.weight']
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hasten.exceptions import ConfigurationError


class SkippedModule(nn.Module):
    """A module of another pipeline stage: returns its first argument unchanged (no parameters).

    Args:
        name: the module's name in the full model (for ``repr`` and error messages).
    """

    def __init__(self, name: str) -> None:
        super().__init__()
        self.skipped_name = name

    def forward(self, hidden: Any, *args: Any, **kwargs: Any) -> Any:
        return hidden

    def extra_repr(self) -> str:
        return f"on another pipeline stage: {self.skipped_name!r}"


def stage_units(model: nn.Module, split_points: list[str], num_stages: int) -> list[tuple[str, int]]:
    """The model's modules at the granularity of the split points, in definition order, each with its stage.

    The units are the children of the split points' ancestors (the ancestors themselves are shared
    containers); a unit at a split point starts the next stage.

    Raises:
        ConfigurationError: a wrong number of split points, a name that is no module, points nested in
            one another or out of model order, an empty first stage, or a shared container that owns
            parameters or buffers itself (they would belong to every stage).
    """
    kind = type(model).__name__
    if len(split_points) != num_stages - 1:
        raise ConfigurationError(
            f"pp_size={num_stages} needs {num_stages - 1} split points (module names where stages 1..{num_stages - 1} "
            f"begin), got {split_points!r}; e.g. ParallelismConfig(pp_size={num_stages}, pp_split_points=[...]) with "
            f"names from [name for name, _ in model.named_modules()].")
    modules = dict(model.named_modules())
    for point in split_points:
        if point not in modules or not point:
            raise ConfigurationError(f"pp split point {point!r} is not a module of {kind} (its top-level modules: "
                                     f"{[name for name, _ in model.named_children()][:12]}).")
    ancestors = {""}
    for point in split_points:
        parts = point.split(".")
        ancestors.update(".".join(parts[:i]) for i in range(1, len(parts)))
    nested = [p for p in split_points if p in ancestors]
    if nested:
        raise ConfigurationError(f"pp split point {nested[0]!r} contains another split point: give points that are "
                                 "not inside one another.")
    for name in sorted(ancestors):
        owned = [key for key, _ in modules[name].named_parameters(recurse=False)]
        owned += [key for key, _ in modules[name].named_buffers(recurse=False)]
        if owned:
            raise ConfigurationError(
                f"{kind} module {name or '(the model)'!r} owns {owned} directly and is shared by several pipeline "
                "stages: move them into a submodule, or choose split points that keep that module in one stage.")
    units: list[tuple[str, int]] = []
    _collect_units(model, "", ancestors, split_points, units)
    if [name for name, _ in units if name in split_points] != split_points:
        raise ConfigurationError(f"pp split points {split_points!r} are not in the model's order: list them as they "
                                 "appear in model.named_modules().")
    if units[0][1] != 0:
        raise ConfigurationError(f"pp split point {split_points[0]!r} is the model's first module: stage 0 would be "
                                 "empty. Split points name where stages 1.. begin.")
    return units


def _collect_units(module: nn.Module, prefix: str, ancestors: set[str], points: list[str],
                   units: list[tuple[str, int]]) -> None:
    for child_name, child in module.named_children():
        name = f"{prefix}{child_name}"
        if name in ancestors:
            _collect_units(child, f"{name}.", ancestors, points, units)
            continue
        stage = (units[-1][1] if units else 0) + (1 if name in points else 0)
        units.append((name, stage))


def cut_stage(model: nn.Module, split_points: list[str], stage_index: int, num_stages: int | None = None) -> nn.Module:
    """Make ``model`` (in place) pipeline stage ``stage_index``: the other stages' modules become no-ops.

    Returns:
        ``model`` itself, holding only its stage's parameters, under their full-model names.
    """
    num_stages = len(split_points) + 1 if num_stages is None else num_stages
    return skip_other_stages(model, stage_units(model, split_points, num_stages), stage_index)


def skip_other_stages(model: nn.Module, units: list[tuple[str, int]], stage_index: int) -> nn.Module:
    """Replace (in place) every unit whose stage is not ``stage_index`` by a :class:`SkippedModule`.

    Args:
        model: the full model.
        units: ``(module name, stage)`` pairs, e.g. from :func:`stage_units`.
        stage_index: the stage this process keeps.

    Returns:
        ``model`` itself, its kept modules under their full-model names.
    """
    for name, stage in units:
        if stage != stage_index:
            parent_name, _, child = name.rpartition(".")
            model.get_submodule(parent_name).register_module(child, SkippedModule(name))
    return model


__all__ = ["SkippedModule", "cut_stage", "skip_other_stages", "stage_units"]
