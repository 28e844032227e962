"""``plan_memory``: one training step of the prepared model, run on fake tensors in a fake process group.

The model is built under torch's ``FakeTensorMode`` (shapes, no storage), prepared as hasten prepares it
(FSDP2 through ``FSDP2Strategy``'s own unit selection, mixed-precision policy and ``fully_shard`` calls;
HSDP and tensor parallel through ``NDParallelStrategy`` on the ``DeviceMesh`` that ``ParallelismConfig``
builds, its ``parallelize_module`` plan first; one replica for DDP), and runs forward, backward and two
optimizer steps inside torch's memory tracker (``MemTracker``, or ``FSDPMemTracker`` when FSDP2 prepared the
model), which attributes every storage to a category. The process group is torch's ``"fake"`` backend over
a ``FakeStore``: a world of any size exists in this one process and its collectives return at once, so rank
0 plans for every rank (FSDP2 pads shards to one size, tensor parallel splits evenly, DDP replicates: the
ranks' plans are equal).

DDP's own memory, its gradient buckets, is allocated by its C++ reducer, which cannot run on fake tensors:
it is added from DDP's rule instead (one bucket copy of every trainable parameter's gradient, as
``gradient_as_bucket_view=False``, Accelerate's default, keeps them), alive for the whole step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hasten._private_api import (
    always_stepping_grad_scaler,
    clear_dtensor_caches,
    composable_checkpoint,
    device_mesh_tensors_outside_fake_mode,
    dtensor_propagation_in_own_fake_mode,
    fake_process_group_store,
    fake_tensor_mode,
    memory_tracker,
)
from hasten.base.dataclasses import DistributedType
from hasten.config.parallelism import ParallelismConfig
from hasten.config.plugins.fsdp import FullyShardedDataParallelPlugin
from hasten.config.plugins.fsdp_units import (
    build_wrap_policy,
    checkpoint_targets,
    ignored_module_list,
    select_units,
)
from hasten.exceptions import ConfigurationError
from hasten.memory_plan.inputs import (
    MIXED_PRECISIONS,
    Layout,
    PlanError,
    batch_spec,
    build_model,
    default_loss,
    make_optimizer_factory,
    parse_layout,
)
from hasten.memory_plan.result import MemoryPlan, ModuleMemory, ProcessPlan, categorize
from hasten.memory_plan.zero import model_step, zero_process_plan, zero_settings
from hasten.precision import create_precision
from hasten.strategies.fsdp2 import FSDP2Strategy
from hasten.strategies.fsdp2_gloo import tune_for_gloo
from hasten.strategies.nd import NDParallelStrategy

#: Precisions a plan refuses, and why (one line each).
UNPLANNABLE_PRECISIONS = {
    "fp8": "torchao's Float8Linear computes its scales from the weights' and activations' values (amax), which fake "
           "tensors do not have; plan with 'bf16' (fp8 keeps bf16 weights and optimizer state, its activations are "
           "at most the bf16 plan's)."}

#: Optimizer steps in a plan: the first creates the optimizer state, the second runs with it in place.
PLANNED_STEPS = 2


def plan_memory(model: Any, *, batch: Any = None, batch_size: int | None = None, seq_len: int | None = None,
                input_shape: tuple[int, ...] | None = None, num_processes: int = 1,
                layout: str | Mapping[str, int] | None = None,
                optimizer: str | Callable[[Any], torch.optim.Optimizer] = "adamw", momentum: float = 0.0,
                mixed_precision: str = "no", model_kwargs: Mapping[str, Any] | None = None,
                device_type: str = "cuda", fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
                reshard_after_forward: bool | None = None, activation_checkpointing: bool = False,
                loss_fn: Callable[[Any, dict[str, torch.Tensor]], torch.Tensor] | None = None,
                top_modules: int = 5, deepspeed_config: Mapping[str, Any] | None = None,
                gradient_accumulation_steps: int = 1) -> MemoryPlan:
    """Plan the memory of one training step per process, without allocating it.

    Args:
        model: an ``nn.Module`` on the meta device, a factory returning one, a class path
            ``'pkg.module:Class'`` (with ``model_kwargs``) or a transformers config folder.
        batch: one process's batch as a sample (a tensor or a dict of tensors; meta tensors are fine), or
            None with ``batch_size`` and ``seq_len`` (token ids) or ``input_shape`` (a float input).
        num_processes: the world size planned for (it need not exist here).
        layout: ParallelismConfig sizes: ``'dp_replicate=N'`` (DDP, the default), ``'dp_shard=N'`` (FSDP2),
            ``'dp_replicate=R,dp_shard=S'`` (HSDP), ``'tp=T'`` alone or with either (tensor parallel on the
            model's plan: a transformers model's ``base_model_tp_plan``).
        optimizer: ``'adamw'``, ``'adam'``, ``'sgd'`` (with ``momentum``) or a callable ``params -> Optimizer``.
        mixed_precision: ``'no'``, ``'bf16'`` or ``'fp16'`` (autocast, under FSDP2 also its 16-bit parameter
            policy; fp16 with a GradScaler). ``'fp8'`` is refused (see :data:`UNPLANNABLE_PRECISIONS`).
        device_type: the device the run will use; it picks torch's optimizer implementation (multi-tensor on
            ``'cuda'``, per tensor on ``'cpu'``) and, on ``'cpu'``, hasten's gloo settings for FSDP2.
        fsdp_plugin: FSDP2 settings (wrap policy, ``reshard_after_forward``, ``activation_checkpointing``);
            default: every block in the model's ``_no_split_modules`` is a unit, else the root alone, with
            ``reshard_after_forward`` and ``activation_checkpointing`` as given (they apply to the default only).
        reshard_after_forward: FSDP2 frees gathered parameters after forward (None: the plugin's default, True).
        activation_checkpointing: FSDP2 recomputes each unit's activations in backward.
        loss_fn: ``(output, batch) -> loss``; default the output's ``.loss``, else the mean of the output.
        top_modules: how many of the largest modules to list per process.
        gradient_accumulation_steps: micro-batches per optimizer step (``batch`` is one micro-batch); under FSDP2
            the unsharded gradients stay alive between them, as ``accelerator.accumulate`` keeps them.
        deepspeed_config: for ``layout='zero=2'``/``'zero=3'``: the DeepSpeed config (dict) whose bucket sizes,
            ``overlap_comm`` and stage-3 thresholds size ZeRO's buffers (DeepSpeed's defaults where absent).

    Raises:
        PlanError: a bad layout, model, batch, optimizer or precision (the message names the value and the fix).

    Example:
        >>> plan = plan_memory("path/to/llama-config", batch_size=8, seq_len=128, num_processes=8,
        ...                    layout="dp_shard=8", mixed_precision="bf16")
        >>> print(plan.per_process[0].peak_bytes)
    """
    parsed = parse_layout(layout, num_processes)
    if mixed_precision in UNPLANNABLE_PRECISIONS:
        raise PlanError(f"mixed_precision {mixed_precision!r} cannot be planned: {UNPLANNABLE_PRECISIONS[mixed_precision]}")
    if mixed_precision not in MIXED_PRECISIONS:
        raise PlanError(f"mixed_precision {mixed_precision!r} cannot be planned: use one of {MIXED_PRECISIONS}.")
    if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
        raise PlanError(f"gradient_accumulation_steps={gradient_accumulation_steps!r} must be a positive integer.")
    if device_type not in ("cuda", "cpu"):
        raise PlanError(f"device_type {device_type!r} cannot be planned: use 'cuda' or 'cpu'.")
    if not parsed.sharded and (fsdp_plugin is not None or activation_checkpointing or reshard_after_forward is not None):
        raise PlanError(f"FSDP2 settings (activation checkpointing, reshard_after_forward, fsdp_plugin) need a sharded "
                        f"layout (dp_shard or tp), not {parsed.describe()!r}: use layout='dp_shard={num_processes}'.")
    label, make_optimizer = make_optimizer_factory(optimizer, momentum=momentum, foreach=device_type == "cuda")
    spec = batch_spec(batch, batch_size, seq_len, input_shape)
    if parsed.zero:
        process = _plan_zero(model, model_kwargs, parsed, num_processes, spec, optimizer, momentum,
                             mixed_precision, deepspeed_config, loss_fn, top_modules)
        label = f"{label} (DeepSpeed ZeRO-{parsed.zero})"
    elif deepspeed_config is not None:
        raise PlanError(f"deepspeed_config sizes a ZeRO plan, but the layout is {parsed.describe()!r}: "
                        "use layout='zero=2' or 'zero=3', or drop deepspeed_config.")
    else:
        process = _plan_parallel(model, model_kwargs, parsed, num_processes, spec, make_optimizer, mixed_precision,
                                 device_type, fsdp_plugin, reshard_after_forward, activation_checkpointing,
                                 loss_fn, top_modules, gradient_accumulation_steps)
    return MemoryPlan(model=_model_label(model), layout=parsed.describe(), num_processes=num_processes,
                      optimizer=label, mixed_precision=mixed_precision,
                      batch={k: list(shape) for k, (shape, _) in spec.items()},
                      per_process=[replace(process, rank=rank) for rank in range(num_processes)])


def _model_label(model: Any) -> str:
    if isinstance(model, nn.Module):
        return type(model).__name__
    if isinstance(model, str) or not callable(model):
        return str(model)
    return getattr(model, "__name__", type(model).__name__)


def _plan_parallel(model: Any, model_kwargs: Mapping[str, Any] | None, parsed: Layout, num_processes: int,
                   spec: dict[str, tuple[tuple[int, ...], torch.dtype]], make_optimizer: Any, mixed_precision: str,
                   device_type: str, fsdp_plugin: FullyShardedDataParallelPlugin | None,
                   reshard_after_forward: bool | None, activation_checkpointing: bool, loss_fn: Any,
                   top_modules: int, accumulation_steps: int) -> ProcessPlan:
    """Rank 0's plan for DDP, FSDP2, HSDP and tensor parallel: the prepared model's step on fake tensors."""
    with _fake_world(num_processes):
        config = _mesh_config(parsed) if parsed.sharded else None
        with fake_tensor_mode(), dtensor_propagation_in_own_fake_mode(), device_mesh_tensors_outside_fake_mode():
            built, _ = build_model(model, model_kwargs)
            plugin = fsdp_plugin or _default_plugin(built, reshard_after_forward, activation_checkpointing)
            return _run_step(built, parsed, config, spec, make_optimizer, mixed_precision, device_type,
                             plugin, loss_fn, top_modules, accumulation_steps)


def _plan_zero(model: Any, model_kwargs: Mapping[str, Any] | None, parsed: Layout, num_processes: int,
               spec: dict[str, tuple[tuple[int, ...], torch.dtype]], optimizer: Any, momentum: float,
               mixed_precision: str, deepspeed_config: Mapping[str, Any] | None, loss_fn: Any,
               top_modules: int) -> ProcessPlan:
    """Rank 0's plan under DeepSpeed ZeRO: the model's forward and backward on fake tensors, ZeRO's buffers by
    rule (``hasten.memory_plan.zero``)."""
    name = optimizer.lower() if isinstance(optimizer, str) else getattr(optimizer, "__name__", "custom")
    if name == "sgd" and momentum:
        name = "sgd(momentum)"
    with fake_tensor_mode():
        built, _ = build_model(model, model_kwargs)
        settings = zero_settings(parsed.zero, deepspeed_config, built)
        inputs = {key: torch.zeros(shape, dtype=dtype) for key, (shape, dtype) in spec.items()}
        outputs = _record_outputs(built)
        try:
            step = model_step(built, inputs, mixed_precision, loss_fn)
        except PlanError:
            raise
        except Exception as exc:  # noqa: BLE001 - a model that cannot run this batch: one line, not a traceback
            raise PlanError(f"the planned step failed for batch {_shapes(spec)} under layout {parsed.describe()!r} "
                            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); check the "
                            "batch shape and the model's forward arguments.") from None
        finally:
            for handle in outputs.pop("__handles__", []):
                handle.remove()
        process = zero_process_plan(step, settings, num_processes, name)
        return replace(process, largest_modules=_largest_modules(built, outputs, top_modules))


@contextmanager
def _fake_world(world_size: int) -> Iterator[None]:
    """A default process group of ``world_size`` ranks on torch's fake backend, for the duration of a plan."""
    if dist.is_initialized():
        raise PlanError("plan_memory needs its own fake process group, but this process already runs one "
                        f"(world size {dist.get_world_size()}): plan before the run starts, or in another process "
                        "(`hasten estimate-memory --train ...`).")
    clear_dtensor_caches()  # DTensor caches meshes by shape, not by group: nothing may outlive a world
    dist.init_process_group("fake", store=fake_process_group_store(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        clear_dtensor_caches()


def _default_plugin(model: nn.Module, reshard_after_forward: bool | None,
                    activation_checkpointing: bool) -> FullyShardedDataParallelPlugin:
    """FSDP2 settings for a plan: the model's own blocks (``_no_split_modules``) as units when it names any."""
    wrap = "transformer_based_wrap" if getattr(model, "_no_split_modules", None) else None
    return FullyShardedDataParallelPlugin(auto_wrap_policy=wrap, reshard_after_forward=reshard_after_forward,
                                          activation_checkpointing=activation_checkpointing)


def _mesh_config(layout: Layout) -> ParallelismConfig:
    """The layout's ``ParallelismConfig`` holding its ``DeviceMesh``, built by hasten's one mesh builder (as the
    ``Accelerator`` builds a run's) on the fake process group."""
    config = ParallelismConfig(dp_replicate_size=layout.dp_replicate, dp_shard_size=layout.dp_shard,
                               tp_size=layout.tp)
    return replace(config, device_mesh=config.build_device_mesh("cpu"))


def _strategy(layout: Layout, config: ParallelismConfig, precision: Any,
              plugin: FullyShardedDataParallelPlugin) -> FSDP2Strategy:
    """The strategy a real run's ``Accelerator`` picks for ``layout`` (``connector.build_parts``): the N-D one for
    HSDP and tensor parallel, FSDP2 on the mesh for ``dp_shard`` alone."""
    device = torch.device("cpu")
    if layout.n_dimensional:
        return NDParallelStrategy(device, precision, DistributedType.FSDP, layout.size, config=config, plugin=plugin)
    return FSDP2Strategy(device, precision, DistributedType.FSDP, layout.size, plugin=plugin,
                         world_mesh=config.device_mesh)


def _prepare(model: nn.Module, layout: Layout, config: ParallelismConfig | None, precision: Any,
             device_type: str, plugin: FullyShardedDataParallelPlugin) -> nn.Module:
    """``model`` with this run's precision and, when sharded, tensor parallel and FSDP2's units as hasten's
    strategy applies them (``FSDP2Strategy._shard``'s steps, minus moving and scattering real weights)."""
    if config is None:
        precision.convert_module(model)
        if precision.native_amp:
            precision.wrap_forward(model)
        return model
    strategy = _strategy(layout, config, precision, plugin)
    strategy.apply_precision(model)
    strategy._before_fully_shard(model)  # tensor parallel on the mesh's "tp" dimension (N-D strategy)
    ignored = ignored_module_list(model, plugin.ignored_modules)
    units = select_units(model, build_wrap_policy(plugin, model), ignored)
    if plugin.activation_checkpointing:
        for module in checkpoint_targets(model, units, ignored):
            composable_checkpoint()(module)
    strategy._fully_shard(model, units, ignored)  # the strategy's own fully_shard calls, minus moving real weights
    if device_type == "cpu":  # hasten's CPU runs use gloo, where the strategy applies these two settings
        tune_for_gloo(model, units)
    return model


def _run_step(model: nn.Module, layout: Layout, config: ParallelismConfig | None,
              spec: dict[str, tuple[tuple[int, ...], torch.dtype]],
              make_optimizer: Callable[[Any], torch.optim.Optimizer], mixed_precision: str, device_type: str,
              plugin: FullyShardedDataParallelPlugin, loss_fn: Any, top_modules: int,
              accumulation_steps: int) -> ProcessPlan:
    """Prepare ``model``, run :data:`PLANNED_STEPS` steps inside torch's tracker; rank 0's plan."""
    precision = create_precision(mixed_precision, "cpu")
    scaler = always_stepping_grad_scaler("cpu") if mixed_precision == "fp16" else None
    try:
        model = _prepare(model, layout, config, precision, device_type, plugin)
    except ConfigurationError as exc:  # e.g. a model without a tensor-parallel plan, or a tp size it cannot split
        raise PlanError(f"layout {layout.describe()!r} cannot prepare this model: {str(exc).splitlines()[0]}") from None
    optimizer = make_optimizer(model.parameters())
    inputs = {key: torch.zeros(shape, dtype=dtype) for key, (shape, dtype) in spec.items()}
    outputs = _record_outputs(model)
    tracker = memory_tracker(model if layout.sharded else None, optimizer if layout.sharded else None)
    if layout.sharded:
        tracker.track_inputs(tuple(inputs.values()))
    else:
        tracker.track_external(model, optimizer, *inputs.values())
    try:
        with tracker:
            for _ in range(PLANNED_STEPS):
                train_step(model, optimizer, inputs, loss_fn, scaler=scaler, accumulation_steps=accumulation_steps,
                           after_micro_step=tracker.reset_mod_stats)
                tracker.reset_mod_stats()  # the trackers keep one iteration's module stats; the peak stays
    except PlanError:
        raise
    except Exception as exc:  # noqa: BLE001 - a model that cannot run this batch: one line, not a traceback
        # A split the model's forward cannot follow (tp above its key/value heads) fails here too, as in a real run.
        split = f", and whether tp={layout.tp} splits every attention head whole" if layout.tp > 1 else ""
        raise PlanError(f"the planned step failed for batch {_shapes(spec)} under layout {layout.describe()!r} "
                        f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); check the batch "
                        f"shape and the model's forward arguments{split}.") from None
    finally:
        for handle in outputs.pop("__handles__", []):
            handle.remove()
    sums = categorize(tracker.get_tracker_snapshot("peak")[torch.device("cpu")])
    if layout.dp_replicate > 1 and not layout.sharded:  # DDP; HSDP's replicas all-reduce FSDP2's own buffers
        sums["communication"] += ddp_bucket_bytes(model)
    return ProcessPlan(rank=0, peak_bytes=sum(sums.values()), **sums,
                       largest_modules=_largest_modules(model, outputs, top_modules))


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: dict[str, torch.Tensor],
               loss_fn: Any = None, *, scaler: Any = None, accumulation_steps: int = 1,
               after_micro_step: Callable[[], None] | None = None) -> torch.Tensor:
    """One step as a training loop runs it: ``accumulation_steps`` forwards and backwards (FSDP2 keeps its
    unsharded gradients without reducing them until the last, as ``accelerator.accumulate`` has it), the
    optimizer step (through ``scaler``, a GradScaler, under fp16), ``zero_grad``. ``after_micro_step`` runs
    between micro-batches (the trackers keep one forward's module stats at a time)."""
    set_sync = getattr(model, "set_requires_gradient_sync", None)
    for micro_step in range(accumulation_steps):
        if set_sync is not None:
            set_sync(micro_step == accumulation_steps - 1)
        output = model(inputs["input"]) if list(inputs) == ["input"] else model(**inputs)
        loss = loss_fn(output, inputs) if loss_fn is not None else default_loss(output)
        if accumulation_steps > 1:
            loss = loss / accumulation_steps
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if after_micro_step is not None and micro_step < accumulation_steps - 1:
            after_micro_step()
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def ddp_bucket_bytes(model: nn.Module) -> int:
    """The bytes of DDP's gradient buckets: one copy of every trainable parameter's gradient."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def _record_outputs(model: nn.Module) -> dict[str, Any]:
    """Forward hooks that note the output bytes of each module holding parameters of its own (first call)."""
    record: dict[str, Any] = {"__handles__": []}
    for name, module in model.named_modules():
        if not any(True for _ in module.parameters(recurse=False)):
            continue

        def hook(_module: nn.Module, _args: Any, output: Any, name: str = name) -> None:
            if name not in record and isinstance(output, torch.Tensor):
                record[name] = output.numel() * output.element_size()

        record["__handles__"].append(module.register_forward_hook(hook))
    return record


def _largest_modules(model: nn.Module, outputs: dict[str, Any], count: int) -> tuple[ModuleMemory, ...]:
    found = []
    for name, module in model.named_modules():
        params = list(module.parameters(recurse=False))
        if not params:
            continue
        local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
        found.append(ModuleMemory(name or "(root)", sum(t.numel() * t.element_size() for t in local),
                                  int(outputs.get(name, 0))))
    found.sort(key=lambda m: m.parameter_bytes + m.output_bytes, reverse=True)
    return tuple(found[:count])


def _shapes(spec: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> str:
    return ", ".join(f"{k}{tuple(shape)}:{str(dtype).removeprefix('torch.')}" for k, (shape, dtype) in spec.items())
