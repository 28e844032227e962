"""N-D parallelism on one ``DeviceMesh``: HSDP, tensor parallel, FSDP2 + TP, HSDP + TP (CP on CUDA).

The mesh comes with the :class:`~hasten.config.parallelism.ParallelismConfig` (``config.device_mesh``: the
``Accelerator`` builds it once per run), laid out ``(dp_replicate, dp_shard, cp, tp)``. Preparing a model: rank 0's full weights are kept, tensor
parallel is applied on the ``tp`` sub-mesh (``parallelize_module``), then ``fully_shard`` runs over the
data-parallel sub-mesh (2-D ``(dp_replicate, dp_shard)`` = HSDP), and rank 0's weights are scattered
into every shard. The data-parallel mesh always exists (a ``dp_shard`` dimension of size 1 when no
data dimension is asked for), so TP-only and DDP + TP runs go through the same FSDP2 path: with one
shard, ``fully_shard`` keeps whole parameters and only all-reduces gradients across replicas.

Everything else (accumulation, clipping over DTensors, DCP checkpoints that reshard onto another mesh)
is the FSDP2 strategy's.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
from torch import nn

from hasten.config.parallelism import ParallelismConfig
from hasten.config.plugins.fsdp import FullyShardedDataParallelPlugin
from hasten.exceptions import ConfigurationError
from hasten.strategies.fsdp2 import FSDP2Strategy

# transformers' style names beyond the four plain ones, mapped to the styles below (``to_parallel_styles``).
_TRANSFORMERS_STYLES = {"colwise_rep": "colwise_rep", "colwise_gather_output": "colwise_rep",
                        "rowwise_rep": "rowwise_rep", "rowwise_split_input": "rowwise_rep",
                        "embedding_rowwise": "embedding_rowwise", "embedding_colwise": "colwise_rep",
                        "local": "replicate", "local_params": "replicate", "gather": "replicate",
                        "replicate": "replicate", "replicated_with_grad_allreduce": "replicate",
                        "all_reduce": "replicate"}
_KNOWN_STYLES = {"colwise", "rowwise", "sequence_parallel", "replicate", "colwise_rep", "rowwise_rep",
                 "embedding_rowwise"}


class NDParallelStrategy(FSDP2Strategy):
    """FSDP2 on a multi-dimensional mesh, with tensor parallelism on its ``tp`` dimension.

    Args:
        device: this process's device.
        precision: an ``FSDPPrecision``.
        distributed_type: ``DistributedType.FSDP``.
        num_processes: processes in the run (must equal ``config.total_size``).
        config: the sizes and handlers; its ``device_mesh`` is the run's mesh (built here when None).
        plugin: FSDP settings (``SHARDED_STATE_DICT`` checkpoints by default: reshardable through DCP).
    """

    def __init__(self, device: torch.device, precision: Any, distributed_type: Any, num_processes: int = 1, *,
                 config: ParallelismConfig, plugin: FullyShardedDataParallelPlugin | None = None) -> None:
        if plugin is None:
            plugin = FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT")
        super().__init__(device, precision, distributed_type, num_processes, plugin=plugin,
                         world_mesh=config.device_mesh)
        config.validate(num_processes, device_type=device.type)
        self.config = config

    # ---------------------------------------------------------------------------------- meshes
    def _layout(self) -> ParallelismConfig:
        return self.config

    @property
    def device_mesh(self) -> Any:
        """The mesh ``fully_shard`` shards over: ``dp_shard`` (x ``cp``), with ``dp_replicate`` first for HSDP."""
        if self._mesh is None:
            mesh = self.world_mesh
            shard = "dp_shard_cp" if self.config.cp_enabled and self.config.dp_shard_enabled else (
                "cp" if self.config.cp_enabled else "dp_shard")
            self._mesh = mesh[("dp_replicate", shard)] if self.config.dp_replicate_enabled else mesh[shard]
        return self._mesh

    # ------------------------------------------------------------------------------ tensor parallel
    def _before_fully_shard(self, model: nn.Module) -> None:
        if not self.config.tp_enabled:
            return
        from torch.distributed.tensor.parallel import parallelize_module

        plan = resolve_tp_plan(model, self.config)
        check_tp_plan(model, plan, self.config.tp_size)  # type: ignore[arg-type]
        # src_data_rank=None: no broadcast here; rank 0's full weights are scattered into the shards afterwards.
        parallelize_module(model, self.world_mesh["tp"], to_parallel_styles(plan), src_data_rank=None)


# ------------------------------------------------------------------------------------ TP plans
def resolve_tp_plan(model: nn.Module, config: ParallelismConfig) -> dict[str, Any]:
    """The plan to apply: the user's ``tp_handler.tp_plan``, else the transformers model's own plan.

    Patterns are expanded to the model's module names (``*`` matches one name component), so every
    pattern must match at least one module.

    Raises:
        ConfigurationError: no plan anywhere, or a pattern that matches no module.
    """
    handler = config.tp_handler
    plan = dict(handler.tp_plan) if handler is not None and handler.tp_plan else _transformers_plan(model)
    if not plan:
        raise ConfigurationError(
            f"tp_size={config.tp_size} but {type(model).__name__} has no tensor-parallel plan: pass one, e.g. "
            "ParallelismConfig(tp_size=2, tp_handler=TorchTensorParallelConfig(tp_plan={'0': 'colwise', "
            "'2': 'rowwise'})), or use a transformers model with a `_tp_plan`/`base_model_tp_plan`.")
    names = [name for name, _ in model.named_modules() if name]
    expanded: dict[str, Any] = {}
    for pattern, style in plan.items():
        parts = pattern.split(".")
        matched = [n for n in names if len(n.split(".")) == len(parts)
                   and all(fnmatch.fnmatchcase(a, b) for a, b in zip(n.split("."), parts))]
        if not matched:
            raise ConfigurationError(f"tp_plan pattern {pattern!r} matches no module of {type(model).__name__} "
                                     f"(its modules include {names[:8]}); nn.Sequential children are named by index.")
        if isinstance(style, str):
            style = _TRANSFORMERS_STYLES.get(style, style)
            if style not in _KNOWN_STYLES:
                raise ConfigurationError(
                    f"The tensor-parallel plan maps {pattern!r} to {plan[pattern]!r}, a transformers style hasten does "
                    f"not run (packed, MoE and expert-parallel layers); supported: {sorted(_KNOWN_STYLES)} and "
                    f"{sorted(_TRANSFORMERS_STYLES)}. Give a plan of your own (TorchTensorParallelConfig(tp_plan=...)).")
        for name in matched:
            expanded[name] = style
    return expanded


def _transformers_plan(model: nn.Module) -> dict[str, Any]:
    """A transformers model's plan: ``model._tp_plan``, else the config's ``base_model_tp_plan`` under its prefix."""
    plan = dict(getattr(model, "_tp_plan", None) or {})
    if plan:
        return plan
    config = getattr(model, "config", None)
    base_plan = getattr(config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and hasattr(model, prefix) and getattr(model, prefix) is not model:
        return {f"{prefix}.{key}": value for key, value in base_plan.items()}
    return dict(base_plan)


#: The plan a transformers model carries (``_tp_plan``, else its config's ``base_model_tp_plan``), or ``{}``.
transformers_tp_plan = _transformers_plan


def check_tp_plan(model: nn.Module, plan: dict[str, Any], tp_size: int) -> None:
    """Refuse a plan whose split dimensions ``tp_size`` does not divide (same answer on every rank).

    Raises:
        ConfigurationError: naming the layer, its width and ``tp_size``.
    """
    for name, style in plan.items():
        if not isinstance(style, str):
            continue
        module = model.get_submodule(name)
        split = _split_width(module, style)
        if split is not None and split[1] % tp_size:
            raise ConfigurationError(
                f"tp_size={tp_size} does not divide layer {name!r} ({type(module).__name__}, style {style!r}): its "
                f"{split[0]} is {split[1]}, and {split[1]} % {tp_size} = {split[1] % tp_size}. Choose a tp_size that "
                "divides every split width, or leave that layer out of the plan.")


def _split_width(module: nn.Module, style: str) -> tuple[str, int] | None:
    colwise = style.startswith("colwise")
    if not style.startswith(("colwise", "rowwise", "embedding_rowwise")):
        return None
    if isinstance(module, nn.Linear):
        return ("out_features", module.out_features) if colwise else ("in_features", module.in_features)
    if isinstance(module, nn.Embedding):
        return ("embedding_dim", module.embedding_dim) if colwise else ("num_embeddings", module.num_embeddings)
    return None


def to_parallel_styles(plan: dict[str, Any]) -> dict[str, Any]:
    """Style names to PyTorch ``ParallelStyle`` objects; ``"replicate"`` modules are left whole (not in the plan)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    styles: dict[str, Any] = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "sequence_parallel": SequenceParallel,
              "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
              "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
              # token ids arrive whole on every rank; each rank looks up its rows of the table, then a sum
              "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate())}
    out = {}
    for name, style in plan.items():
        if style == "replicate":
            continue  # every TP rank keeps the whole module and computes the same result
        out[name] = styles[style]() if isinstance(style, str) else style
    return out


__all__ = ["NDParallelStrategy", "check_tp_plan", "resolve_tp_plan", "to_parallel_styles", "transformers_tp_plan"]
