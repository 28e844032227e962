"""Sharded training with FSDP2 (``torch.distributed.fsdp.fully_shard``) over a one-dimensional device mesh.

``prepare(model, optimizer)`` shards every wrap unit (see ``hasten.config.plugins.fsdp_units``), then the root, and points
the optimizer at the new (DTensor) parameters. Every rank ends up with rank 0's weights: rank 0's full
state dict is scattered into the shards, so ranks need not build identical models, and with
``cpu_ram_efficient_loading`` (or a model whose parameters are on the meta device, e.g. built under
``init_empty_weights``) the other ranks never hold a full copy. With one process hasten runs FSDP2 on
a one-rank mesh (its own single-process group if none exists), so the same script works unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hasten._private_api import (
    composable_checkpoint,
    fsdp_param_records,
    pending_gradient,
    set_pending_gradient,
)
from hasten.checkpointing import dcp as sharded, files as ckpt, safe_load
from hasten.checkpointing.sinks import Sink
from hasten.config.parallelism import ParallelismConfig
from hasten.config.plugins.fsdp import FullyShardedDataParallelPlugin
from hasten.config.plugins.fsdp_units import (
    build_wrap_policy,
    checkpoint_targets,
    ignored_module_list,
    select_units,
)
from hasten.exceptions import CheckpointError, ConfigurationError
from hasten.strategies.base import CheckedState, Strategy, unwrap_common
from hasten.strategies.fsdp2_gloo import tune_for_gloo, uses_gloo


def _as_fsdp(model: nn.Module) -> Any:
    """``model`` as an ``FSDPModule`` (its methods are added by ``fully_shard`` at run time)."""
    return model


def is_fsdp2_module(model: Any) -> bool:
    """True for a module sharded with ``fully_shard``."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


class FSDP2Strategy(Strategy):
    """Parameters, gradients and optimizer state sharded across processes (FSDP2).

    Args:
        device: this process's device.
        precision: the precision plugin; an :class:`FSDPPrecision` provides FSDP's
            ``MixedPrecisionPolicy`` (the plugin's, else one derived from ``mixed_precision``).
        distributed_type: ``DistributedType.FSDP``.
        num_processes: processes in the run (1 works: a one-rank mesh).
        plugin: the ``FullyShardedDataParallelPlugin`` (defaults when None).
        world_mesh: the run's named ``DeviceMesh`` when a ``ParallelismConfig`` lays the run out (the
            ``Accelerator`` builds it once and hands it over); None: one over every process, built here.

    Example:
        >>> accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(reshard_after_forward=False))
        >>> model, optimizer = accelerator.prepare(model, optimizer)
    """

    def __init__(self, device: torch.device, precision: Any, distributed_type: Any, num_processes: int = 1, *,
                 plugin: FullyShardedDataParallelPlugin | None = None, world_mesh: Any = None) -> None:
        super().__init__(device, precision, distributed_type, num_processes)
        if plugin is None:
            plugin = FullyShardedDataParallelPlugin()
        if not isinstance(plugin, FullyShardedDataParallelPlugin):
            raise ConfigurationError(f"fsdp_plugin must be a hasten FullyShardedDataParallelPlugin, got "
                                     f"{type(plugin).__module__}.{type(plugin).__name__}; build it with "
                                     "`from hasten import FullyShardedDataParallelPlugin`.")
        self.fsdp_plugin = plugin
        self._world_mesh = world_mesh
        self._mesh: Any = None

    # ------------------------------------------------------------------------------ mesh and policies
    @property
    def world_mesh(self) -> Any:
        """The run's named ``DeviceMesh``: the one handed over, else built here on first use by the one
        builder (``ParallelismConfig.build_device_mesh``) from :meth:`_layout`."""
        if self._world_mesh is None:
            self._ensure_group()
            self._world_mesh = self._layout().build_device_mesh(self.device.type)
        return self._world_mesh

    def _layout(self) -> ParallelismConfig:
        """The sizes of a mesh built here: every process on ``dp_shard``."""
        return ParallelismConfig(dp_shard_size=dist.get_world_size())

    @property
    def device_mesh(self) -> Any:
        """The mesh ``fully_shard`` shards over: every data-parallel rank (the world mesh's ``dp`` view)."""
        if self._mesh is None:
            mesh = self.world_mesh
            self._mesh = mesh if mesh.ndim == 1 else mesh["dp"]
        return self._mesh

    def mixed_precision_policy(self) -> Any:
        """FSDP's ``MixedPrecisionPolicy`` for this run (the precision plugin's, see ``FSDPPrecision``)."""
        mp_policy = getattr(self.precision, "mp_policy", None)
        if mp_policy is None:  # a plain precision given directly: wrap it for the plugin's policy
            from hasten.precision.fsdp import FSDPPrecision

            self.precision = FSDPPrecision(self.precision, self.fsdp_plugin.mixed_precision_policy)
            mp_policy = self.precision.mp_policy
        return mp_policy()

    def _offload_policy(self) -> Any:
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        if not self.fsdp_plugin.cpu_offload:
            return OffloadPolicy()
        # Pinned memory needs an accelerator; on a CPU-only run the shards simply stay where they are.
        return self.fsdp_plugin.offload_policy() or CPUOffloadPolicy(pin_memory=self.device.type == "cuda")

    # ----------------------------------------------------------------------------------- preparing
    def prepare(self, models: list[nn.Module], optimizers: list[torch.optim.Optimizer], *,
                device_placement: Sequence[bool], evaluation_mode: bool = False,
                accumulation_steps: int | None = None) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
        """Shard the model and re-point each optimizer at the sharded parameters (same groups, same state).

        Raises:
            ConfigurationError: several models in one call, a trainable model without its optimizer,
                or an optimizer holding parameters of another model.
        """
        if evaluation_mode or not models:
            return super().prepare(models, optimizers, device_placement=device_placement,
                                   evaluation_mode=evaluation_mode)
        if len(models) > 1:
            raise ConfigurationError(f"{type(self).__name__} prepares one model per prepare call; prepare got "
                                     f"{len(models)} models.")
        model = models[0]
        if not optimizers and any(p.requires_grad for p in model.parameters()):
            raise ConfigurationError(f"{type(self).__name__} needs the model and its optimizer in the same "
                                     "call: `model, optimizer = accelerator.prepare(model, optimizer)`.")
        names = _parameter_names(model)
        foreign = [p for opt in optimizers for group in opt.param_groups for p in group["params"] if id(p) not in names]
        if foreign:
            raise ConfigurationError(
                f"An optimizer passed to prepare holds {len(foreign)} parameter(s) (shapes "
                f"{[tuple(p.shape) for p in foreign[:4]]}) that are not in {type(model).__name__}. Under FSDP2 "
                "each optimizer must optimize the parameters of the model prepared with it.")
        sharded_model = self._shard(model, device_placement[0])
        new_params = dict(sharded_model.named_parameters(remove_duplicate=False))
        for optimizer in optimizers:
            _repoint_optimizer(optimizer, names, new_params)
        return [sharded_model], optimizers

    def place_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Nothing: the optimizer state follows its (sharded, possibly offloaded) parameters."""

    def wrap_model(self, model: nn.Module, *, evaluation_mode: bool = False) -> nn.Module:
        """Shard a model prepared without an optimizer (frozen, or for inference)."""
        if evaluation_mode:
            return model
        return self._shard(model, device_placement=False)

    def is_wrapped(self, model: nn.Module) -> bool:
        return is_fsdp2_module(unwrap_common(model))

    def _shard(self, model: nn.Module, device_placement: bool) -> nn.Module:
        if self.is_wrapped(model):
            return model
        plugin = self.fsdp_plugin
        self.device_mesh  # noqa: B018 - creates the process group and mesh first
        rank, world = dist.get_rank(), dist.get_world_size()
        on_meta = any(p.is_meta for p in model.parameters())
        if _rank0_flag(on_meta, world):  # every rank raises together instead of waiting in a collective
            raise ConfigurationError(
                f"{type(model).__name__} has parameters on the meta device on rank 0, so there are no weights to "
                "shard. Build it with real weights on rank 0; the other ranks may build it on the meta device "
                "(init_empty_weights) and receive their shards from rank 0.")
        # Rank 0's weights are the source of truth: every rank receives its shards from them below.
        source = model.state_dict() if rank == 0 and world > 1 else {}
        kept_buffers = {name: buf for name, buf in model.named_buffers() if not buf.is_meta}
        if (plugin.cpu_ram_efficient_loading or on_meta) and rank != 0:
            _parameters_to_meta(model)  # the full copy on this rank is dropped before sharding
        elif device_placement and not plugin.cpu_offload:
            model.to(self.device)
        self.apply_precision(model)
        self._before_fully_shard(model)
        ignored = ignored_module_list(model, plugin.ignored_modules)
        units = select_units(model, build_wrap_policy(plugin, model), ignored)
        if plugin.activation_checkpointing:
            checkpoint = composable_checkpoint()
            for module in checkpoint_targets(model, units, ignored):
                checkpoint(module)
        self._fully_shard(model, units, ignored)
        if any(p.is_meta for p in model.parameters()):
            model.to_empty(device="cpu" if plugin.cpu_offload else self.device)
            _restore_buffers(model, kept_buffers)
        if world > 1:
            sharded.load_full_model_state(model, source)
            _broadcast_buffers(model)
        return model

    def _before_fully_shard(self, model: nn.Module) -> None:
        """Called on the placed model right before its units are sharded (tensor parallel goes here)."""

    def _fully_shard(self, model: nn.Module, units: list[nn.Module], ignored: list[nn.Module]) -> None:
        from torch.distributed.fsdp import fully_shard

        reshard = self.fsdp_plugin.reshard_after_forward
        ignored_params = {p for module in ignored for p in module.parameters()}
        options: dict[str, Any] = {"mesh": self.device_mesh, "mp_policy": self.mixed_precision_policy(),
                                   "offload_policy": self._offload_policy()}
        if ignored_params:
            options["ignored_params"] = ignored_params
        for unit in units:
            fully_shard(unit, reshard_after_forward=reshard, **options)
        # The root's parameters are needed again at the start of backward: FSDP's default (None) keeps
        # them gathered instead of freeing and re-gathering them at once.
        fully_shard(model, reshard_after_forward=None if reshard is True else reshard, **options)
        if uses_gloo(self.device):
            tune_for_gloo(model, units)

    # ------------------------------------------------------------------------------- the step
    @contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Accumulate unsharded gradients locally; the next synchronising backward reduce-scatters them."""
        inner = unwrap_common(model)
        if not is_fsdp2_module(inner):
            yield
            return
        _as_fsdp(inner).set_requires_gradient_sync(False)
        try:
            yield
        finally:
            _as_fsdp(inner).set_requires_gradient_sync(True)

    @contextmanager
    def trigger_sync_in_backward(self, model: nn.Module) -> Iterator[None]:
        inner = unwrap_common(model)
        if is_fsdp2_module(inner):
            _as_fsdp(inner).set_requires_gradient_sync(True)  # FSDP2 decides in backward, so this is enough
        yield

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global norm over every shard; returns it as a plain tensor (same on every rank).

        Parameters left unsharded (``ignored_modules``) count with their local gradients.
        """
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.experimental import implicit_replication

        params = [p for p in parameters if p.grad is not None]
        if not params:
            return torch.tensor(0.0)
        sharded_grads = [p.grad for p in params if isinstance(p.grad, DTensor)]
        local_grads = [p.grad for p in params if p.grad is not None and not isinstance(p.grad, DTensor)]
        norms = []
        if sharded_grads:
            total = torch.nn.utils.get_total_norm(sharded_grads, norm_type)
            norms.append(total.full_tensor() if isinstance(total, DTensor) else total)
        if local_grads:
            norms.append(torch.nn.utils.get_total_norm(local_grads, norm_type).to(norms[0].device if norms else "cpu"))
        stacked = torch.stack([n.float() for n in norms])
        total_norm = stacked.max() if norm_type == float("inf") else torch.linalg.vector_norm(stacked, norm_type)
        with implicit_replication():  # the plain scale factor multiplies DTensor gradients
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm)
        return total_norm

    # -------------------------------------------------------------------------------- state dicts
    def model_state_dict(self, model: nn.Module, *, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The full state dict on CPU, **on the main process only** (others get ``{}``), as Accelerate does.

        Every process must call it (it gathers). Gathering to one rank keeps memory at one full copy.
        """
        inner = unwrap_common(model)
        if not is_fsdp2_module(inner):
            return super().model_state_dict(model, unwrap=unwrap)
        return sharded.full_model_state(inner)

    # -------------------------------------------------------------------------------- checkpoints
    @property
    def _sharded_format(self) -> bool:
        return self.fsdp_plugin.state_dict_type == "SHARDED_STATE_DICT"

    def weights_for_save(self, models: list[nn.Module]) -> list[dict[str, torch.Tensor]]:
        """Nothing to show the pre-hooks: :meth:`save` gathers or writes shards itself."""
        return []

    def save(self, models: list[nn.Module], optimizers: list[torch.optim.Optimizer], folder: Path, *,
             weights: list[dict[str, torch.Tensor]], writer: bool, safe_serialization: bool = True,
             sink: Sink, engine_kwargs: Mapping[str, Any] | None = None) -> None:
        """SHARDED_STATE_DICT: DCP folders written by every rank; FULL_STATE_DICT: gathered files from rank 0."""
        self.engine_checkpoint_kwargs("save_state", engine_kwargs or {})
        inner_models = [unwrap_common(m) for m in models]
        for i, model in enumerate(inner_models):
            if self._sharded_format:
                sharded.save_model(model, sharded.model_dir(folder, i), sink=sink)
            else:
                state = sharded.full_model_state(model) if is_fsdp2_module(model) else model.state_dict()
                if dist.get_rank() == 0:
                    ckpt.save_model_weights(state, folder, i, safe=True, sink=sink)
        for i, optimizer in enumerate(optimizers):
            owner = _owner(optimizer, inner_models)
            if self._sharded_format:
                sharded.save_optimizer(owner, optimizer, sharded.optimizer_dir(folder, i), sink=sink)
            else:
                state = sharded.full_optimizer_state(owner, optimizer)
                if dist.get_rank() == 0:
                    ckpt.torch_save(state, folder / ckpt.OPTIMIZER.format(suffix=ckpt.suffix(i)), sink=sink)

    def check(self, models: list[nn.Module], optimizers: list[torch.optim.Optimizer], folder: Path, *,
              strict: bool = True, map_location: Any = "cpu") -> CheckedState:
        """Check every model/optimizer file or DCP folder (either format loads) before anything changes."""
        for i, model in enumerate(models):
            path = sharded.model_dir(folder, i)
            if path.is_dir():
                sharded.check_model_folder(unwrap_common(model), path)
                continue
            weights_path = folder / ckpt.SAFE_MODEL.format(suffix=ckpt.suffix(i))
            if not weights_path.is_file():
                raise CheckpointError(f"{folder} has no weights for model #{i}: expected the folder {path.name}/ "
                                      f"(SHARDED_STATE_DICT) or {weights_path.name} (FULL_STATE_DICT).")
            _check_safetensors(unwrap_common(model), weights_path)
        inner_models = [unwrap_common(m) for m in models]
        for i, optimizer in enumerate(optimizers):
            path = sharded.optimizer_dir(folder, i)
            file = folder / ckpt.OPTIMIZER.format(suffix=ckpt.suffix(i))
            if path.is_dir():
                sharded.check_optimizer_folder(_owner(optimizer, inner_models), optimizer, path)
            elif file.is_file():  # memory-mapped: only the structure and shapes are read here
                state = safe_load.torch_load(file, file, mmap=True)
                sharded.check_full_optimizer_state(_owner(optimizer, inner_models), optimizer, state, file)
            else:
                raise CheckpointError(f"{folder} has no state for optimizer #{i}: expected the folder {path.name}/ or "
                                      f"{file.name}.")
        return CheckedState()  # load() reads the folders/files itself (models and optimizers together)

    def load(self, models: list[nn.Module], optimizers: list[torch.optim.Optimizer], folder: Path,
             checked: CheckedState, *, strict: bool = True, engine_kwargs: Mapping[str, Any] | None = None) -> None:
        """Load what the checkpoint holds, whichever ``state_dict_type`` it was saved with."""
        self.engine_checkpoint_kwargs("load_state", engine_kwargs or {})
        inner_models = [unwrap_common(m) for m in models]
        for i, model in enumerate(inner_models):
            path = sharded.model_dir(folder, i)
            if path.is_dir():
                sharded.load_model(model, path)
                continue
            if is_fsdp2_module(model):
                weights = ckpt.read_model_weights(folder, i)[1] if dist.get_rank() == 0 else {}
                sharded.load_full_model_state(model, _fill_tied(model, weights) if weights else {})
            else:  # a model prepared for evaluation only: every rank holds all of it
                ckpt.load_model_weights(model, ckpt.read_model_weights(folder, i)[1])
        for i, optimizer in enumerate(optimizers):
            owner = _owner(optimizer, inner_models)
            path = sharded.optimizer_dir(folder, i)
            if path.is_dir():
                sharded.load_optimizer(owner, optimizer, path)
            else:
                file = folder / ckpt.OPTIMIZER.format(suffix=ckpt.suffix(i))
                state = ckpt.torch_load(file) if dist.get_rank() == 0 else {}
                sharded.load_full_optimizer_state(owner, optimizer, state)


    def accumulated_gradients(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """This rank's unsharded gradients gathered under ``no_sync``, not yet reduce-scattered.

        FSDP2 keeps them on its per-parameter records (``FSDPParam``): in the unsharded parameter's
        ``grad``, or, when gradients are reduced in another dtype, in a pending-gradient slot; both are FSDP2
        internals, read through ``hasten._private_api.pending_gradient``.
        Parameters FSDP2 does not manage (ignored modules) keep theirs on ``param.grad``.
        """
        inner = unwrap_common(model)
        if not is_fsdp2_module(inner):
            return super().accumulated_gradients(model)
        grads: dict[str, torch.Tensor] = {}
        managed: set[int] = set()
        for name, record in _fsdp_params(inner):
            managed.add(id(record.sharded_param))
            pending = pending_gradient(record)
            if pending is not None:  # under tensor parallel: this rank's TP slice of the unsharded gradient
                grads[name] = _local(pending).detach().cpu().contiguous()
        for name, param in inner.named_parameters():
            if id(param) not in managed and param.grad is not None and not _is_dtensor(param.grad):
                grads[name] = param.grad.detach().cpu().contiguous()
        return grads

    def restore_accumulated_gradients(self, model: nn.Module, grads: dict[str, torch.Tensor], path: Path) -> None:
        """Hand the saved gradients back to FSDP2: the next backward adds to them, then reduce-scatters."""
        inner = unwrap_common(model)
        if not is_fsdp2_module(inner):
            super().restore_accumulated_gradients(model, grads, path)
            return
        records = dict(_fsdp_params(inner))
        params = dict(inner.named_parameters())
        unknown = [name for name in grads if name not in records and name not in params]
        if unknown:
            raise CheckpointError(f"{path} holds gradients for parameters the model lacks: {unknown[:8]}")
        for name, grad in grads.items():
            if name in records:
                record = records[name]
                set_pending_gradient(record, grad.to(record.sharded_param.device))
            else:
                params[name].grad = grad.to(params[name].device, dtype=params[name].dtype)


# ---------------------------------------------------------------------------------------- helpers
def _fsdp_params(model: nn.Module) -> list[tuple[str, Any]]:
    """``(parameter name, FSDPParam)`` for every parameter FSDP2 manages in ``model`` (FSDP2 internals)."""
    from torch.distributed.fsdp import FSDPModule

    names = {id(p): name for name, p in model.named_parameters()}
    found = []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for record in fsdp_param_records(module):
            found.append((names[id(record.sharded_param)], record))
    return found


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (the tensor itself otherwise)."""
    return tensor.to_local() if _is_dtensor(tensor) else tensor  # type: ignore[attr-defined, no-any-return]


def _is_dtensor(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _rank0_flag(value: bool, world: int) -> bool:
    """Rank 0's ``value``, on every rank."""
    if world == 1:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return bool(holder[0])


def _parameter_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> first name`` (tied parameters keep the first of their names)."""
    names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    return names


def _repoint_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str], new_params: dict[str, nn.Parameter]) -> None:
    """Swap each parameter of ``optimizer`` for its sharded replacement, keeping groups and state."""
    for group in optimizer.param_groups:
        replaced = []
        for old in group["params"]:
            new = new_params[names[id(old)]]
            if old in optimizer.state:
                optimizer.state[new] = _shard_state(optimizer.state.pop(old), old, new)
            replaced.append(new)
        group["params"] = replaced


def _shard_state(state: dict[str, Any], old: torch.Tensor, new: torch.Tensor) -> dict[str, Any]:
    """Existing per-parameter state (a resumed optimizer) gets the parameter's sharding."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(new, DTensor):
        return state
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == old.shape:
            value = distribute_tensor(value.detach().to(new.to_local().device), new.device_mesh, new.placements)
        out[key] = value
    return out


def _parameters_to_meta(model: nn.Module) -> None:
    """Replace parameters by meta tensors (tied parameters stay tied); buffers are kept."""
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or param.is_meta:
                continue
            if id(param) not in replaced:
                replaced[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
            module._parameters[name] = replaced[id(param)]


def _restore_buffers(model: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    """``to_empty`` also wiped real buffers: put back those that had values."""
    for name, value in buffers.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        current = owner._buffers[leaf]
        owner._buffers[leaf] = value.to(current.device if current is not None else value.device)


def _broadcast_buffers(model: nn.Module) -> None:
    """Buffers are replicated, not sharded: give every rank rank 0's values (non-persistent ones too)."""
    for buf in model.buffers():
        dist.broadcast(buf, src=0)


def _owner(optimizer: torch.optim.Optimizer, models: list[nn.Module]) -> nn.Module:
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for model in models:
        if any(id(p) in params for p in model.parameters()):
            return model
    raise CheckpointError("A prepared optimizer optimizes none of the prepared models' parameters; prepare it together "
                          "with its model: `model, optimizer = accelerator.prepare(model, optimizer)`.")


def _tied_aliases(model: nn.Module) -> dict[str, list[str]]:
    """``name -> other names of the same parameter`` for tied parameters."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return {n: [a for a in names if a != n] for names in groups.values() if len(names) > 1 for n in names}


def _fill_tied(model: nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors keeps one name per tied tensor: give the other names the same tensor again."""
    for name, aliases in _tied_aliases(model).items():
        if name not in weights:
            present = [a for a in aliases if a in weights]
            if present:
                weights[name] = weights[present[0]]
    return weights


def _check_safetensors(model: nn.Module, path: Path) -> None:
    """Keys and global shapes of a ``model.safetensors`` against the model, without reading the tensors."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            saved = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
    except Exception as exc:
        raise CheckpointError(f"Could not read checkpoint file {path}: {exc}. It is truncated or corrupted.") from exc
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    aliases = _tied_aliases(model)
    missing = [k for k in expected if k not in saved and not any(a in saved for a in aliases.get(k, ()))]
    unexpected = [k for k in saved if k not in expected]
    wrong = [f"{k}: file {saved[k]} vs model {expected[k]}" for k in saved if k in expected and saved[k] != expected[k]]
    problems = [f"{label} {items[:8]}" for label, items in
                (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatches", wrong)) if items]
    if problems:
        raise CheckpointError(f"{path} does not match the prepared model {type(model).__name__}: "
                              + "; ".join(problems) + ". Nothing was loaded.")


__all__ = ["FSDP2Strategy", "is_fsdp2_module"]
