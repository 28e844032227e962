"""Pipeline parallelism composed with sharding and tensor parallelism: each stage tensor-parallelised over
``tp`` and ``fully_shard``-ed over its data-parallel sub-mesh.

With ``ParallelismConfig(pp_size=P, dp_shard_size=S, tp_size=T)`` (and optionally ``dp_replicate_size=R``:
HSDP) the run's one mesh is ``(pp, dp_replicate, dp_shard, tp)``, pipeline outermost (stages exchange only
activations) and tensor parallel innermost. Every process holds one stage (the model with the other
stages' modules made no-ops, names kept; two or more stages under Interleaved1F1B and LoopedBFS, whose
views share the modules sharded here), applies the tensor-parallel plan to the stage's own modules on
the ``tp`` dimension (as :mod:`hasten.strategies.nd` does for a whole model), and shards it with FSDP2 over
the ``dp_shard`` dimension (``(dp_replicate, dp_shard)`` for HSDP; a ``dp_shard`` of 1 under PP x TP alone,
where FSDP2 keeps whole parameters and only reduces across replicas):

* the stage's units (the largest modules that hold no skipped module) are sharded one by one, then the
  stage itself, so torch's ``PipelineStage`` sees an ``FSDPModule`` and runs FSDP2's gradient
  reduce-scatter once per step, after the schedule's last backward (``perform_reduce_grad``);
* before sharding, every process of a stage takes the weights of the stage's first data-parallel rank
  (one broadcast per dimension), as DDP and hasten's FSDP2 do, so ranks need not build identical models;
* the optimizer is pointed at the stage's new (DTensor) parameters, keeping its groups.

Each data-parallel rank reads its own share of the batch; FSDP2 averages the gradients over the shards
(and replicas), so a step equals one process on the whole batch, as for PP x DDP.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hasten.config.parallelism import ParallelismConfig, TorchTensorParallelConfig
from hasten.exceptions import ConfigurationError
from hasten.strategies.pipeline_split import SkippedModule


def shards_stages(config: ParallelismConfig) -> bool:
    """True when a pipeline stage is sharded (``dp_shard_size > 1``) or tensor-parallel: its parameters are
    DTensors and FSDP2 owns its gradient reduction."""
    return config.dp_shard_enabled or config.tp_enabled


#: The schedules that split each backward into input and weight gradients (torch's ``stage_backward_weight``).
_SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def check_sharded_schedule(schedule: str, config: ParallelismConfig) -> None:
    """Refuse a split-backward schedule over sharded or tensor-parallel stages: its weight gradients,
    computed apart from the backward, come out wrong there (measured: off by 6e-2 after 3 steps)."""
    if schedule in _SPLIT_BACKWARD and shards_stages(config):
        raise ConfigurationError(
            f"pp_schedule={schedule!r} computes weight gradients apart from the backward, which FSDP2/TP stages "
            "(dp_shard_size/tp_size) do not reduce correctly: use 'Interleaved1F1B' or 'LoopedBFS' there (or "
            "'1F1B'/'GPipe'), or dp_replicate_size.")


def shard_mesh(config: ParallelismConfig, mesh: Any) -> Any:
    """The sub-mesh a stage is sharded over: ``dp_shard``, with ``dp_replicate`` first for HSDP."""
    return mesh[("dp_replicate", "dp_shard")] if config.dp_replicate_enabled else mesh["dp_shard"]


def stage_units(stage: nn.Module) -> list[nn.Module]:
    """The largest submodules of ``stage`` that hold parameters and no :class:`SkippedModule`, in order."""
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, SkippedModule):
                continue
            if any(isinstance(m, SkippedModule) for m in child.modules()):
                visit(child)
            elif any(True for _ in child.parameters()):
                units.append(child)

    visit(stage)
    return units


def shard_stage(stage: nn.Module, config: ParallelismConfig, mesh: Any, optimizers: list[torch.optim.Optimizer],
                mp_policy: Any = None) -> nn.Module:
    """Shard this process's ``stage`` (in place) over its data-parallel sub-mesh; repoint ``optimizers``.

    Args:
        stage: the cut stage, on its device, whose parameters ``optimizers`` already hold (only them).
        config: the run's config (``dp_shard_size > 1``).
        mesh: the run's mesh, ``pp`` outermost.
        optimizers: the optimizers over ``stage``'s parameters.
        mp_policy: FSDP2's ``MixedPrecisionPolicy`` (None: FSDP2's default, full precision).

    Returns:
        ``stage``, now an ``FSDPModule`` holding DTensor parameters under the same names.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    _take_first_replica(stage, config, mesh)
    names = {id(param): name for name, param in stage.named_parameters()}
    if config.tp_enabled:
        _tensor_parallelize(stage, config, mesh)
    shard_over = shard_mesh(config, mesh)
    policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    for unit in stage_units(stage):
        fully_shard(unit, mesh=shard_over, mp_policy=policy)
    fully_shard(stage, mesh=shard_over, mp_policy=policy)
    params = dict(stage.named_parameters())
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [params[names[id(old)]] for old in group["params"]]
    return stage


def _take_first_replica(stage: nn.Module, config: ParallelismConfig, mesh: Any) -> None:
    """Give every process of this stage the parameters and buffers of the stage's first data-parallel rank."""
    tensors = [*stage.parameters(), *stage.buffers()]
    for dim in ("tp", "dp_shard", "dp_replicate"):
        if getattr(config, f"{dim}_size") > 1:
            group = mesh[dim].get_group()
            source = dist.get_global_rank(group, 0)
            with torch.no_grad():
                for tensor in tensors:
                    dist.broadcast(tensor.data, src=source, group=group)


def _tensor_parallelize(stage: nn.Module, config: ParallelismConfig, mesh: Any) -> None:
    """Apply the tensor-parallel plan's entries for this stage's own modules on the ``tp`` sub-mesh.

    A pattern may match modules of other stages only (each stage applies its part), but each must match a
    module of some stage: the stages compare which patterns matched (one collective over ``pp``, at prepare).

    Raises:
        ConfigurationError: no plan, a pattern that matches no module of any stage, or a width ``tp_size``
            does not divide (the same answer on every process).
    """
    from torch.distributed.tensor.parallel import parallelize_module

    from hasten.strategies.nd import check_tp_plan, resolve_tp_plan, to_parallel_styles, transformers_tp_plan

    handler = config.tp_handler
    plan = dict(handler.tp_plan) if handler is not None and handler.tp_plan else transformers_tp_plan(stage)
    if not plan:
        resolve_tp_plan(stage, config)  # raises its error naming the ways to give a plan
    own = _own_module_names(stage)
    matched = {pattern: any(_matches(name, pattern) for name in own) for pattern in plan}
    every: list[Any] = [None] * dist.get_world_size(mesh["pp"].get_group())
    dist.all_gather_object(every, matched, group=mesh["pp"].get_group())
    nowhere = [pattern for pattern in plan if not any(stage_matched[pattern] for stage_matched in every)]
    if nowhere:
        raise ConfigurationError(f"tp_plan patterns {nowhere} match no module of {type(stage).__name__} on any "
                                 "pipeline stage (nn.Sequential children are named by index).")
    mine = {pattern: style for pattern, style in plan.items() if matched[pattern]}
    if not mine:
        return
    expanded = resolve_tp_plan(_OwnModules(stage, own), dataclasses.replace(
        config, tp_handler=TorchTensorParallelConfig(tp_plan=mine)))
    check_tp_plan(stage, expanded, int(config.tp_size))  # type: ignore[arg-type]
    # src_data_rank=None: every tp rank already holds the same full weights (_take_first_replica).
    parallelize_module(stage, mesh["tp"], to_parallel_styles(expanded), src_data_rank=None)


def _own_module_names(stage: nn.Module) -> list[str]:
    """Names of the stage's modules that are not, and are not inside, a :class:`SkippedModule`."""
    skipped = [name for name, module in stage.named_modules() if isinstance(module, SkippedModule)]
    return [name for name, _ in stage.named_modules() if name
            and not any(name == s or name.startswith(s + ".") for s in skipped)]


def _matches(name: str, pattern: str) -> bool:
    parts, pattern_parts = name.split("."), pattern.split(".")
    return len(parts) == len(pattern_parts) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, pattern_parts))


class _OwnModules(nn.Module):
    """A view of a stage whose ``named_modules`` lists only its own modules (to expand plan patterns)."""

    def __init__(self, stage: nn.Module, own: list[str]) -> None:
        super().__init__()
        self._view = [(name, stage.get_submodule(name)) for name in own]

    def named_modules(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return iter([("", self), *self._view])


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a DTensor (the tensor itself otherwise): in-place changes reach the DTensor."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value of a DTensor (a collective over its mesh), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


__all__ = ["check_sharded_schedule", "full_value", "local_part", "shard_mesh", "shard_stage", "shards_stages", "stage_units"]
