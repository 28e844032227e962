"""The ``Accelerator``: Accelerate's facade over hasten's parts (state, precision, strategy, data)."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import logging
import os
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from hasten.accelerator._checkpoint import CheckpointMixin
from hasten.accelerator._collectives import CollectivesMixin
from hasten.accelerator._compat import TrivialFeaturesMixin
from hasten.accelerator._fault_tolerance import FaultToleranceMixin, resolve_fault_tolerance
from hasten.accelerator._parallelism import NDParallelismMixin, resolve_layout, with_run_mesh
from hasten.accelerator._preemption import PreemptionMixin
from hasten.accelerator._prepare import PrepareMixin
from hasten.accelerator._process import ProcessControlMixin
from hasten.accelerator._tracking import TrackingMixin
from hasten.base.dataclasses import (
    PROFILE_PATTERN_NAME,
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    DistributedType,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProfileKwargs,
    ProjectConfiguration,
)
from hasten.base.fp8 import AORecipeKwargs, FP8RecipeKwargs, MSAMPRecipeKwargs, TERecipeKwargs
from hasten.base.imports import is_compiled_module
from hasten.base.modeling import extract_model_from_parallel
from hasten.checkpointing.at_exit import wait_with_notice
from hasten.config import env as hasten_env
from hasten.config.schema import LaunchConfig
from hasten.connector import apply_config_file, build_parts, resolve_settings
from hasten.environments import current_process_info
from hasten.exceptions import ConfigurationError
from hasten.precision import detach_autocast_forward
from hasten.precision.fp8 import ao_recipe_from_launch
from hasten.runtime.watchdog import TRACKER
from hasten.state import AcceleratorState, GradientState
from hasten.tracking import filter_trackers

_NOT_GIVEN: Any = object()
_HANDLER_ATTRIBUTES = {
    DistributedDataParallelKwargs: "ddp_handler",
    GradScalerKwargs: "scaler_handler",
    InitProcessGroupKwargs: "init_handler",
    AutocastKwargs: "autocast_handler",
    ProfileKwargs: "profile_handler",
    AORecipeKwargs: "ao_recipe_handler",
    TERecipeKwargs: "te_recipe_handler",
    MSAMPRecipeKwargs: "msamp_recipe_handler",
    FP8RecipeKwargs: "fp8_recipe_handler",
}


class _Accumulate(contextlib.ContextDecorator):
    """``Accelerator.accumulate``'s context: entering advances the micro-step; on micro-steps that do not
    synchronise, the models' ``no_sync`` contexts are entered (as Accelerate's ExitStack does).

    A class rather than a ``contextlib.contextmanager`` generator: it runs on every step of an
    accumulating loop, and a generator-based context with an ExitStack costs a dozen Python frames.
    """

    __slots__ = ("accelerator", "models", "stack")

    def __init__(self, accelerator: Accelerator, models: tuple[nn.Module, ...]) -> None:
        self.accelerator, self.models = accelerator, models
        self.stack: contextlib.ExitStack | None = None

    def __enter__(self) -> None:
        accelerator = self.accelerator
        accelerator._do_sync()
        state = accelerator.gradient_state
        if not self.models or state.sync_gradients or (
                accelerator._use_distributed and state.plugin_kwargs.get("sync_each_batch", False)):
            return
        contexts = [context for context in map(accelerator._strategy.no_sync, self.models)
                    if not isinstance(context, contextlib.nullcontext)]  # nothing to enter on one device
        if contexts:
            with contextlib.ExitStack() as stack:  # a context failing to enter unwinds the ones before it
                for context in contexts:
                    stack.enter_context(context)
                self.stack = stack.pop_all()

    def __exit__(self, *exc: Any) -> bool | None:
        stack, self.stack = self.stack, None
        return stack.__exit__(*exc) if stack is not None else None


def _unsupported(name: str, value: Any, what: str) -> None:
    if value is not None:
        raise ConfigurationError(f"Accelerator({name}=...) is not supported by hasten yet: {what}. "
                                 f"Remove `{name}` (got {type(value).__name__}).")


def _collect_handlers(kwargs_handlers: list[KwargsHandler] | None) -> dict[type, KwargsHandler]:
    handlers: dict[type, KwargsHandler] = {}
    for handler in kwargs_handlers or []:
        if not isinstance(handler, KwargsHandler):
            raise ConfigurationError(f"kwargs_handlers must hold KwargsHandler objects (e.g. "
                                     f"DistributedDataParallelKwargs(...)), got {handler!r}")
        if type(handler) in handlers:
            raise ConfigurationError(f"kwargs_handlers holds two {type(handler).__name__} objects; pass one.")
        handlers[type(handler)] = handler
    return handlers


logger = logging.getLogger(__name__)
#: Lines already reported about the configuration file in this process (each is reported once).
_REPORTED: set[str] = set()


def _launch_configuration(arguments: dict[str, Any]) -> LaunchConfig | None:
    """``hasten launch``'s configuration, else the configuration file that ``hasten launch`` would read, as a
    process started by any other launcher applies it (code wins; a disagreement is reported once per machine)."""
    launch = hasten_env.launch_config()  # typed LaunchConfig, None when not launched by `hasten launch`
    if launch is not None:
        return launch
    found = hasten_env.worker_config_file()
    if found is None:
        return None
    world = current_process_info()[1]
    if torch.distributed.is_available() and torch.distributed.is_initialized():  # a group someone else started (Ray)
        world = dataclasses.replace(world, world_size=torch.distributed.get_world_size(),
                                    rank=torch.distributed.get_rank())
    launch, line = apply_config_file(arguments, found[1], str(found[0]), world)
    if line is not None and world.local_rank == 0 and line not in _REPORTED:
        _REPORTED.add(line)
        logger.warning(line)
    return launch


class Accelerator(TrackingMixin, ProcessControlMixin, CollectivesMixin, PrepareMixin, CheckpointMixin,
                  NDParallelismMixin, PreemptionMixin, FaultToleranceMixin, TrivialFeaturesMixin):
    """Run one training loop unchanged on a CPU, GPUs or many machines (Accelerate's API).

    Example:
        >>> accelerator = Accelerator(mixed_precision="bf16")
        >>> model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        >>> for x, y in loader:
        ...     loss = loss_fn(model(x), y)
        ...     accelerator.backward(loss)
        ...     optimizer.step(); optimizer.zero_grad()
    """

    # Set from ``kwargs_handlers`` (None when not given), as in Accelerate.
    ddp_handler: DistributedDataParallelKwargs | None
    scaler_handler: GradScalerKwargs | None
    init_handler: InitProcessGroupKwargs | None
    autocast_handler: AutocastKwargs | None
    profile_handler: ProfileKwargs | None
    ao_recipe_handler: AORecipeKwargs | None

    def __init__(self, device_placement: bool = True, split_batches: Any = _NOT_GIVEN, mixed_precision: Any = None,
                 gradient_accumulation_steps: int = 1, cpu: bool = False,
                 dataloader_config: DataLoaderConfiguration | None = None, deepspeed_plugin: Any = None,
                 fsdp_plugin: Any = None, torch_tp_plugin: Any = None, megatron_lm_plugin: Any = None,
                 rng_types: list[Any] | None = None, log_with: Any = None, project_dir: str | os.PathLike[str] | None = None,
                 project_config: ProjectConfiguration | None = None,
                 gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
                 step_scheduler_with_optimizer: bool = True, kwargs_handlers: list[KwargsHandler] | None = None,
                 dynamo_backend: Any = None, dynamo_plugin: Any = None, deepspeed_plugins: Any = None,
                 parallelism_config: Any = None, fault_tolerance: Any = None) -> None:
        if split_batches is not _NOT_GIVEN:
            warnings.warn("Accelerator(split_batches=...) is ignored (as in Accelerate >= 1.0): pass "
                          "`dataloader_config=DataLoaderConfiguration(split_batches=...)` instead.", FutureWarning,
                          stacklevel=2)
        self._check_unsupported(deepspeed_plugin, deepspeed_plugins, fsdp_plugin, torch_tp_plugin,
                                megatron_lm_plugin, parallelism_config)
        if torch_tp_plugin is not None:  # Accelerate's mapping onto ParallelismConfig (and its warning)
            warnings.warn("`TorchTensorParallelPlugin` is deprecated and will be removed in a future version of "
                          "Accelerate. Please use the `ParallelismConfig` with `tp_size` instead.", FutureWarning,
                          stacklevel=2)
            if parallelism_config is None:
                from hasten.parallelism_config import ParallelismConfig

                parallelism_config = ParallelismConfig(tp_size=torch_tp_plugin.tp_size)
        handlers = _collect_handlers(kwargs_handlers)
        for cls, attribute in _HANDLER_ATTRIBUTES.items():
            setattr(self, attribute, handlers.get(cls))
        if mixed_precision is None and AcceleratorState._shared_state:
            # A second Accelerator in the process reuses the first one's precision, as in Accelerate.
            mixed_precision = AcceleratorState._shared_state.get("_mixed_precision")
        arguments = {"mixed_precision": mixed_precision, "gradient_accumulation_steps": gradient_accumulation_steps,
                     "gradient_accumulation_plugin": gradient_accumulation_plugin, "dynamo_backend": dynamo_backend,
                     "dynamo_plugin": dynamo_plugin, "cpu": cpu, "fsdp_plugin": fsdp_plugin,
                     "deepspeed_plugin": deepspeed_plugin or deepspeed_plugins,
                     "parallelism_config": parallelism_config, "kwargs_handlers": handlers}
        launch = _launch_configuration(arguments)
        self._settings = resolve_settings(arguments, launch)
        if self._settings.mixed_precision == "fp8" and AORecipeKwargs not in handlers:
            # torchao's defaults (as Accelerate fills in), with the launch configuration's AO switches
            recipe = ao_recipe_from_launch(launch.fp8_config if launch is not None else None)
            self.ao_recipe_handler = handlers[AORecipeKwargs] = recipe
        # The run's layout, completed from the launch and checked before any group starts (a new config).
        self._settings = dataclasses.replace(self._settings, parallelism_config=resolve_layout(
            self._settings.parallelism_config, launch, self._settings.cpu))
        init_kwargs = self.init_handler.to_kwargs() if self.init_handler is not None else {}
        self.state = AcceleratorState(mixed_precision=self._settings.mixed_precision, cpu=self._settings.cpu,
                                      fsdp_plugin=self._settings.fsdp_plugin,
                                      deepspeed_plugin=self._settings.deepspeed_plugin,
                                      parallelism_config=self._settings.parallelism_config,
                                      _from_accelerator=True, **init_kwargs)
        # The mesh, built once now that the group runs; the strategy and the state take it from the config.
        self._settings = dataclasses.replace(self._settings, parallelism_config=with_run_mesh(
            self._settings.parallelism_config, self.state.device.type))
        self.state._attach_layout(self._settings.parallelism_config)
        self._precision, self._strategy = build_parts(self._settings, self.state.device, self.state.distributed_type,
                                                      self.state.num_processes, handlers)
        self.state._attach_strategy(self._strategy)  # the state answers from it (and the static trigger_sync_in_backward)
        self._strategy.setup()
        self._backward = self._strategy.backward_fn()  # fixed with the strategy: asked once
        self._use_distributed = bool(self.state.use_distributed)  # for accumulate(): fixed for the run
        plugin = gradient_accumulation_plugin or GradientAccumulationPlugin(
            num_steps=self._settings.gradient_accumulation_steps, adjust_scheduler=False)
        self.gradient_state = GradientState(gradient_accumulation_plugin=plugin)
        self._init_attributes(device_placement, dataloader_config, rng_types, project_dir, project_config,
                              step_scheduler_with_optimizer, log_with)
        # hasten: per-step fault tolerance over replica groups (hasten launch --replica_groups N; torchft)
        self._fault_tolerance = resolve_fault_tolerance(fault_tolerance)

    @staticmethod
    def _check_unsupported(deepspeed_plugin: Any, deepspeed_plugins: Any, fsdp_plugin: Any, torch_tp_plugin: Any,
                           megatron_lm_plugin: Any, parallelism_config: Any) -> None:
        if deepspeed_plugin is not None and deepspeed_plugins is not None:
            raise ConfigurationError("deepspeed_plugin and deepspeed_plugins are aliases: pass only one.")
        _unsupported("megatron_lm_plugin", megatron_lm_plugin, "Megatron-LM is not available")

    def _init_attributes(self, device_placement: bool, dataloader_config: DataLoaderConfiguration | None,
                         rng_types: list[Any] | None, project_dir: Any, project_config: ProjectConfiguration | None,
                         step_scheduler_with_optimizer: bool, log_with: Any) -> None:
        self.device_placement = device_placement
        self.dataloader_config = dataloader_config or DataLoaderConfiguration()
        self.rng_types = [str(getattr(r, "value", r)) for r in (rng_types if rng_types is not None else ["generator"])]
        self.project_configuration = project_config or ProjectConfiguration()
        if project_dir is not None:
            self.project_configuration.set_directories(os.fspath(project_dir))
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.scaler = self._precision.scaler
        self.step = 0
        self._models: list[nn.Module] = []
        self._optimizers: list[Any] = []
        self._schedulers: list[Any] = []
        self._dataloaders: list[Any] = []
        self._custom_objects: list[Any] = []
        # OrderedDicts: torch's RemovableHandle keeps a weak reference to them (a plain dict cannot have one)
        self._save_model_state_pre_hook: dict[Any, Any] = collections.OrderedDict()
        self._load_model_state_pre_hook: dict[Any, Any] = collections.OrderedDict()
        self._trigger_flag = False
        self.trackers: list[Any] = []
        self.log_with = filter_trackers(log_with, self.logging_dir)

    # ------------------------------------------------------------------------------------ properties
    @property
    def mixed_precision(self) -> str:
        return self._settings.mixed_precision

    @property
    def native_amp(self) -> bool:
        return self._precision.native_amp

    @property
    def sync_gradients(self) -> bool:
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state.sync_gradients = value

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigurationError(f"gradient_accumulation_steps={value!r} must be a positive integer.")
        self.gradient_state.plugin_kwargs["num_steps"] = value

    @property
    def split_batches(self) -> bool:
        return self.dataloader_config.split_batches

    @property
    def dispatch_batches(self) -> bool | None:
        return self.dataloader_config.dispatch_batches

    @property
    def even_batches(self) -> bool:
        return self.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self.dataloader_config.even_batches = value

    @property
    def use_seedable_sampler(self) -> bool:
        return self.dataloader_config.use_seedable_sampler

    @property
    def non_blocking(self) -> bool:
        return self.dataloader_config.non_blocking

    @property
    def project_dir(self) -> str | None:
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        return self.project_configuration.logging_dir

    @property
    def save_iteration(self) -> int:
        return self.project_configuration.iteration

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """True when the last optimizer step was skipped (fp16 overflow)."""
        return any(opt.step_was_skipped for opt in self._optimizers)

    @property
    def distributed_type(self) -> Any:
        """Accelerate's ``DistributedType`` of this run (FSDP / DEEPSPEED when sharded)."""
        return self._strategy.distributed_type

    @property
    def is_fsdp2(self) -> bool:
        """True when the model is sharded with FSDP2 (hasten's only FSDP)."""
        return self._strategy.distributed_type == DistributedType.FSDP

    @property
    def deepspeed_plugin(self) -> Any:
        return getattr(self._strategy, "deepspeed_plugin", None)

    # ---------------------------------------------------------------------------------- the step
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` for this setup: divides by the accumulation steps and scales fp16 losses.

        Example:
            >>> accelerator.backward(loss)
        """
        # The strategy's backward_fn: a plain function when it and its precision add nothing (an
        # overhead-bound step then pays two frames, not ten), its own backward otherwise.
        state = self.gradient_state
        if not TRACKER.enabled:
            self._backward(loss, sync=state.sync_gradients, accumulation_steps=state.num_steps, **kwargs)
            return
        TRACKER.enter("backward (gradient all-reduce)")  # seen by the hang watchdog
        try:
            self._backward(loss, sync=state.sync_gradients, accumulation_steps=state.num_steps, **kwargs)
        finally:
            TRACKER.exit()

    def _do_sync(self) -> None:
        state = self.gradient_state
        if state.sync_with_dataloader and state.end_of_dataloader:
            self.step = 0
            state._set_sync_gradients(True)
        else:
            self.step += 1
            state._set_sync_gradients(self.step % state.num_steps == 0)

    def accumulate(self, *models: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients over ``gradient_accumulation_steps`` micro-batches.

        Inside, DDP skips its all-reduce except on the synchronising micro-step (or the last batch of a
        prepared data loader); the prepared optimizer and scheduler only act on that step.

        Example:
            >>> for batch in loader:
            ...     with accelerator.accumulate(model):
            ...         accelerator.backward(loss_fn(model(batch)))
            ...         optimizer.step(); optimizer.zero_grad()
        """
        return _Accumulate(self, models)

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Skip gradient synchronisation in backward passes inside the block."""
        with self._strategy.no_sync(model):
            yield

    @staticmethod
    @contextlib.contextmanager
    def trigger_sync_in_backward(model: nn.Module) -> Iterator[None]:
        """Make the next backward synchronise even after forwards run under ``no_sync``.

        A staticmethod, as in Accelerate: it asks the strategy of the process's Accelerator.
        """
        strategy = AcceleratorState._shared_state.get("_strategy")
        if strategy is None:
            yield
            return
        with strategy.trigger_sync_in_backward(model):
            yield

    @contextlib.contextmanager
    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> Iterator[None]:
        """Run the block in the configured mixed precision (for code outside the model's forward)."""
        with self._precision.autocast(autocast_handler):
            yield

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Divide fp16 gradients by the loss scale (all prepared optimizers by default)."""
        if self._precision.scaler is None:
            return
        optimizers: list[Any] = (list(optimizer) if isinstance(optimizer, (list, tuple))
                                 else [optimizer] if optimizer else self._optimizers)
        for opt in optimizers:
            self._strategy.unscale_(getattr(opt, "optimizer", opt))

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2) -> torch.Tensor:
        """Clip gradients by total norm after unscaling; returns the total norm before clipping.

        On a micro-step that does not synchronise, gradients are partial: nothing is unscaled or
        clipped and the norm of the partial gradients is returned. Clip inside
        ``if accelerator.sync_gradients:``.
        """
        parameters = list(parameters)
        if not self.sync_gradients:
            grads = [p.grad for p in parameters if p.grad is not None]
            if not grads:
                return torch.tensor(0.0)
            return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, norm_type) for g in grads]), norm_type)
        self.unscale_gradients()
        self._average_replica_gradients()  # replica groups: clip the gradient of the whole global batch
        return self._strategy.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        """Clip gradients element-wise after unscaling."""
        self.unscale_gradients()
        self._average_replica_gradients()
        self._strategy.clip_grad_value_(parameters, clip_value)

    # -------------------------------------------------------------------------------- utilities
    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True) -> nn.Module:
        """The user's module inside hasten's wrappers (DDP, torch.compile, mixed-precision forward)."""
        compiled = model if is_compiled_module(model) else None
        # then any DataParallel/DDP the user wrapped themselves (Accelerate unwraps those too)
        inner = extract_model_from_parallel(self._strategy.unwrap(model), keep_torch_compile=False)
        if not keep_fp32_wrapper:
            detach_autocast_forward(inner)
        if keep_torch_compile and compiled is not None:
            compiled._orig_mod = inner  # as Accelerate: the compiled wrapper now holds the unwrapped module
            return compiled
        return inner

    def free_memory(self, *objects: Any) -> list[Any]:
        """Drop the references hasten holds to prepared objects and release cached device memory."""
        self._models.clear()
        self._optimizers.clear()
        self._schedulers.clear()
        self._dataloaders.clear()
        self.step = 0
        released = [None for _ in objects]
        gc.collect()
        self.state.device_kind.empty_cache()
        return released

    def clear(self, *objects: Any) -> list[Any]:
        """Alias of :meth:`free_memory`."""
        return self.free_memory(*objects)

    def end_training(self) -> None:
        """Finish the trackers and tear down the process group (call it on every process at the end)."""
        if self._background_saver is not None:
            # an asynchronous save in flight is published (or its failure raised) first, with a notice
            wait_with_notice(self._background_saver, "training ends")
            self._background_saver.release()  # the asynchronous saves' staging buffers (host memory)
        self._finish_trackers()
        self._strategy.teardown()
        self.state.destroy_process_group()

    def save(self, obj: Any, f: str | os.PathLike[str], safe_serialization: bool = False) -> None:
        """Save ``obj`` once (main process, or each machine's first with ``save_on_each_node``), atomically.

        Under replica groups one group writes, as for ``save_state`` (docs/fault-tolerance.md).
        """
        from hasten.base.serialization import save_atomically

        if self._writes_shared_files():
            save_atomically(obj, f, safe_serialization=safe_serialization)

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: list[Any], even_batches: bool | None = None) -> Iterator[None]:
        """Let processes with fewer batches drop out early (``torch.distributed.algorithms.Join``)."""
        if not self.use_distributed:
            warnings.warn("join_uneven_inputs does nothing with a single process.", stacklevel=2)
            yield
            return
        from torch.distributed.algorithms import Join, Joinable

        if not all(isinstance(j, Joinable) for j in joinables):
            # DDP models are Joinable; FSDP2 modules and DeepSpeed engines are not (as in Accelerate, which
            # supports joining for DDP only).
            warnings.warn("Joining uneven inputs is only supported for multi-GPU training, as a result "
                          "`join_uneven_inputs` will have no effect (it needs DDP: multi-process replicated "
                          "training).", stacklevel=2)
            yield
            return
        saved = []
        if even_batches is not None:
            for loader in self._dataloaders:
                sampler: Any = getattr(loader, "batch_sampler", None)
                if hasattr(sampler, "even_batches"):
                    saved.append((sampler, sampler.even_batches))
                    sampler.even_batches = even_batches
                else:
                    warnings.warn("Overriding even_batches is only supported for map-style datasets, yet some "
                                  "dataloaders given were iterable (their batches stay as they are).", stacklevel=2)
        try:
            with Join(joinables):
                yield
        finally:
            for sampler, value in saved:
                sampler.even_batches = value

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """A loader that skips the first ``num_batches`` batches of its next pass only."""
        from hasten.data import skip_first_batches

        return skip_first_batches(dataloader, num_batches=num_batches)

    @contextlib.contextmanager
    def profile(self, profile_handler: ProfileKwargs | None = None) -> Iterator[Any]:
        """Profile the block with ``torch.profiler``; with ``output_trace_dir`` each process writes
        ``profile_{rank}.json`` (a Chrome trace).

        Example:
            >>> with accelerator.profile(ProfileKwargs(output_trace_dir="traces")) as prof:
            ...     train_step()
        """
        handler = profile_handler or self.profile_handler or ProfileKwargs()
        with handler.build() as profiler:
            yield profiler
        if handler.output_trace_dir is not None:
            os.makedirs(handler.output_trace_dir, exist_ok=True)
            profiler.export_chrome_trace(os.path.join(handler.output_trace_dir,
                                                      PROFILE_PATTERN_NAME.format(suffix=self.process_index)))
            self.wait_for_everyone()

    def verify_device_map(self, model: nn.Module) -> bool:
        """True when ``model`` was dispatched over several devices with a device map."""
        return any(len(set(map(str, getattr(m, "hf_device_map", {}).values()))) > 1 for m in model.modules())

    def __deepcopy__(self, memo: dict[int, Any]) -> Accelerator:
        return self

    def __repr__(self) -> str:
        return f"Accelerator(\n{self.state!r})"
