"""DeepSpeed ZeRO (stages 0-3, CPU/NVMe offload) behind the ordinary Accelerator loop.

``deepspeed`` is imported (lazily, when the strategy is built) through ``hasten.base.deepspeed_runtime``.
``accelerator.backward(loss)`` runs ``engine.backward(loss)`` and, on synchronising micro-steps,
``engine.step()`` (clipping, optimizer step, zero_grad, engine-driven scheduler); the prepared
optimizer's ``step``/``zero_grad`` then do nothing. Checkpoints are the engine's own
(``engine.save_checkpoint(folder, "pytorch_model")`` on every rank, as in Accelerate).

Where Accelerate fails on the CPU (it counts one process where DeepSpeed sees the whole gloo group),
hasten hands DeepSpeed the process group it already runs on, so DeepSpeed's world size is
``accelerator.num_processes``, and selects DeepSpeed's "cpu" accelerator when hasten runs on the CPU.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hasten.base.dataclasses import DistributedType
from hasten.base.deepspeed import DummyOptim, DummyScheduler

# Re-exported: these lived here before moving below the plugin (which calls them).
from hasten.base.deepspeed_runtime import import_deepspeed, set_z3_leaf_modules_by_name, zero3_init_context
from hasten.checkpointing import CheckpointError
from hasten.checkpointing.safe_load import check_deepspeed_files
from hasten.checkpointing.sinks import Sink
from hasten.config.plugins.deepspeed import DeepSpeedPlugin
from hasten.exceptions import ConfigurationError
from hasten.precision import Precision
from hasten.precision.deepspeed import DeepSpeedPrecision
from hasten.runtime import process_group
from hasten.strategies.base import CheckedState, Strategy
from hasten.strategies.deepspeed_checks import check_engine_checkpoint

#: Checkpoint tag of the i-th model (Accelerate's folder names ``pytorch_model``, ``pytorch_model_1``...).
MODEL_TAG = "pytorch_model"
_HIDDEN_SIZE_KEYS = ("zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
                     "zero_optimization.stage3_param_persistence_threshold")


class DeepSpeedStrategy(Strategy):
    """ZeRO data parallelism through ``deepspeed.initialize``.

    Args:
        device: this process's device.
        precision: a :class:`DeepSpeedPrecision` (any other precision is converted to one): it writes
            the mode into the DeepSpeed config, and the engine casts and scales itself.
        distributed_type: ``DistributedType.DEEPSPEED``.
        num_processes: processes in the run (DeepSpeed's world size).
        plugin: the :class:`DeepSpeedPlugin`.
        gradient_accumulation_steps: the Accelerator's accumulation steps (fills ``"auto"``).
    """

    def __init__(self, device: torch.device, precision: Precision, distributed_type: DistributedType,
                 num_processes: int = 1, *, plugin: DeepSpeedPlugin, gradient_accumulation_steps: int = 1) -> None:
        if not isinstance(plugin, DeepSpeedPlugin):
            raise ConfigurationError(f"deepspeed_plugin must be a DeepSpeedPlugin, got {type(plugin).__name__}.")
        if not isinstance(precision, DeepSpeedPrecision):
            precision = DeepSpeedPrecision(precision.mixed_precision, device.type)
        super().__init__(device, precision, distributed_type, num_processes)
        self.mixed_precision = precision.mixed_precision
        self.deepspeed_plugin = plugin
        self.gradient_accumulation_steps = gradient_accumulation_steps
        precision.apply(plugin)
        self.deepspeed = import_deepspeed(device.type)
        self.engine: Any = None
        self.deepspeed_config: dict[str, Any] | None = None
        self._call: dict[str, Any] = {"batch_sizes": [], "schedulers": [], "split_batches": False}

    # ------------------------------------------------------------------------------------ prepare
    def observe_prepare_call(self, objects: Sequence[Any], *, split_batches: bool = False) -> None:
        from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES

        native = [o for o in objects if type(o).__name__ in VALID_LR_SCHEDULES]
        if native:
            raise ConfigurationError(
                f"prepare got DeepSpeed's own scheduler {type(native[0]).__name__}: write it in the config's "
                "\"scheduler\" block and pass `DummyScheduler(optimizer, ...)`, or use a torch.optim.lr_scheduler one.")
        self._call = {
            "batch_sizes": [o.batch_size for o in objects if isinstance(o, torch.utils.data.DataLoader)],
            "schedulers": [o for o in objects if isinstance(o, (torch.optim.lr_scheduler.LRScheduler, DummyScheduler))],
            "split_batches": split_batches,
        }

    def prepare(self, models: list[nn.Module], optimizers: list[torch.optim.Optimizer], *,
                device_placement: Sequence[bool], evaluation_mode: bool = False,
                accumulation_steps: int | None = None) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
        """Build the engine (``deepspeed.initialize``) from the model, its optimizer and the filled config.

        Raises:
            ConfigurationError: a second model, several optimizers, or config values hasten cannot fill.
        """
        if evaluation_mode or not models:
            return super().prepare(models, optimizers, device_placement=device_placement,
                                   evaluation_mode=evaluation_mode)
        if len(models) > 1:
            raise ConfigurationError(f"{type(self).__name__} prepares one model per Accelerator; prepare got "
                                     f"{len(models)} models.")
        if self.engine is not None:
            raise ConfigurationError(
                "This Accelerator already holds a DeepSpeed engine; DeepSpeed trains one model per Accelerator "
                "(hasten has no multi-plugin form, `deepspeed_plugins={...}`, yet). Prepare a frozen model with "
                "`accelerator.prepare_model(model, evaluation_mode=True)`, or use a second Accelerator.")
        model = models[0]
        if len(optimizers) > 1:
            raise ConfigurationError(f"DeepSpeed drives one optimizer per model; prepare got {len(optimizers)}. "
                                     "Put the parameters in one optimizer with several param groups.")
        if accumulation_steps is not None:
            self.gradient_accumulation_steps = accumulation_steps
        optimizer = optimizers[0] if optimizers else None
        schedulers = self._call["schedulers"]
        scheduler = schedulers[0] if schedulers else None
        self._ensure_group("gloo" if self.device.type == "cpu" else "nccl")
        # deepspeed.initialize asserts torchrun's variables; a plain `python script.py` run has none.
        process_group.export_rank_variables(self.num_processes)
        config = self._finish_config(model, optimizer, scheduler)
        kwargs: dict[str, Any] = {"model": model, "config": config}
        if isinstance(optimizer, DummyOptim):
            kwargs["model_parameters"] = optimizer.params
            if isinstance(scheduler, DummyScheduler) and scheduler.lr_scheduler_callable is not None:
                kwargs["lr_scheduler"] = scheduler.lr_scheduler_callable
        elif optimizer is not None:
            kwargs["optimizer"] = self._offload_optimizer(optimizer, config)
        engine, ds_optimizer, _, ds_scheduler = self.deepspeed.initialize(**kwargs)
        if isinstance(scheduler, DummyScheduler):
            scheduler.bind(ds_scheduler)
        self.engine = engine
        self.deepspeed_config = config
        return [engine], ([ds_optimizer] if optimizer is not None else [])

    def compile(self, model: nn.Module, backend: str, options: dict[str, Any]) -> nn.Module:
        """``engine.compile``: the engine compiles its module in place and stays the prepared object."""
        engine = self._engine_of(model)
        if engine is None:
            return super().compile(model, backend, options)
        engine.compile(backend=backend, compile_kwargs=dict(options))
        return engine

    def place_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Nothing: ZeRO places (or offloads) the optimizer state itself."""

    def _finish_config(self, model: nn.Module, optimizer: Any, scheduler: Any) -> dict[str, Any]:
        """Fill the config's ``"auto"`` values from this run (Accelerate's rules) and check the objects."""
        plugin = self.deepspeed_plugin
        config = plugin.deepspeed_config
        _check_objects_against_config(config, optimizer, scheduler)
        values: dict[str, Any] = {"gradient_clipping": 1.0,
                                  "zero_optimization.stage3_gather_16bit_weights_on_model_save": False}
        micro = self._micro_batch_size()
        steps = self._accumulation_steps()
        if micro is not None:
            values["train_micro_batch_size_per_gpu"] = micro
            values["train_batch_size"] = micro * steps * self.num_processes
        if any(plugin.is_auto(key) for key in _HIDDEN_SIZE_KEYS):
            values.update(_hidden_size_values(model, [k for k in _HIDDEN_SIZE_KEYS if plugin.is_auto(k)]))
        if isinstance(optimizer, DummyOptim):
            values.update({"optimizer.params.lr": optimizer.lr, "optimizer.params.weight_decay": optimizer.weight_decay})
        elif optimizer is not None:
            config["zero_allow_untested_optimizer"] = True  # any torch optimizer works under ZeRO
        if isinstance(scheduler, DummyScheduler) and scheduler.lr_scheduler_callable is None:
            values.update(self._scheduler_values(scheduler))
        plugin.deepspeed_config_process(must_match=False, **values)
        left = _auto_keys(config)
        if left:
            raise ConfigurationError(f"DeepSpeed config values still 'auto' that hasten cannot fill: {left}. "
                                     "Replace them by numbers in the config.")
        return config

    def _micro_batch_size(self) -> int | None:
        plugin = self.deepspeed_plugin
        if not plugin.is_auto("train_micro_batch_size_per_gpu"):
            return plugin.get_value("train_micro_batch_size_per_gpu")
        sizes = list(self._call["batch_sizes"])
        if not sizes or any(size is None for size in sizes):
            raise ConfigurationError(
                "DeepSpeed's train_micro_batch_size_per_gpu is 'auto', so `accelerator.prepare` needs the training "
                "(or evaluation) DataLoader, with an integer batch_size, in the same call as the model: "
                "`model, optimizer, loader = accelerator.prepare(model, optimizer, loader)`. Or write a number for "
                "train_micro_batch_size_per_gpu in the DeepSpeed config.")
        if self._call["split_batches"]:
            sizes = [size // self.num_processes for size in sizes]
        return min(sizes) if plugin.is_train_batch_min else max(sizes)

    def _accumulation_steps(self) -> int:
        """The config's accumulation steps ("auto": the Accelerator's); DeepSpeed's value wins a conflict."""
        current = self.gradient_accumulation_steps
        plugin = self.deepspeed_plugin
        plugin.fill_match("gradient_accumulation_steps", must_match=False, gradient_accumulation_steps=current)
        configured = int(plugin.get_value("gradient_accumulation_steps"))
        if configured != current:
            warnings.warn(f"Gradient accumulation steps: the Accelerator has {current}, the DeepSpeed config "
                          f"{configured}; using DeepSpeed's value.", stacklevel=4)
        self.gradient_accumulation_steps = configured
        return configured

    def accumulation_steps(self, requested: int) -> int:
        """The engine's accumulation steps once prepared (the config's value wins), else ``requested``."""
        return self.gradient_accumulation_steps if self.engine is not None else requested

    def _scheduler_values(self, scheduler: DummyScheduler) -> dict[str, Any]:
        inner = scheduler.optimizer
        max_lr = inner.defaults["lr"] if getattr(inner, "defaults", None) else getattr(inner, "lr", None)
        values: dict[str, Any] = {"scheduler.params.warmup_min_lr": 0, "scheduler.params.warmup_max_lr": max_lr,
                                  "scheduler.params.warmup_num_steps": scheduler.warmup_num_steps}
        if scheduler.total_num_steps is not None:
            total = scheduler.total_num_steps
            values["scheduler.params.total_num_steps"] = (total if self._call["split_batches"]
                                                          else math.ceil(total / self.num_processes))
        return values

    def _offload_optimizer(self, optimizer: torch.optim.Optimizer, config: dict[str, Any]) -> Any:
        """With optimizer offload DeepSpeed wants its CPU Adam: convert torch Adam/AdamW (as Accelerate does)."""
        device = str(config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")).lower()
        if device == "none" or not config.get("zero_force_ds_cpu_optimizer", True):
            return optimizer
        if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            raise ConfigurationError(
                f"Optimizer offload needs DeepSpeed's CPU Adam; hasten converts torch Adam/AdamW, not "
                f"{type(optimizer).__name__}. Use Adam/AdamW, or set \"zero_force_ds_cpu_optimizer\": false in the config.")
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        defaults = optimizer.defaults
        groups = [{k: v for k, v in group.items() if k in ("params", "lr", "betas", "eps", "weight_decay")}
                  for group in optimizer.param_groups]
        return DeepSpeedCPUAdam(groups, lr=defaults["lr"], betas=defaults["betas"], eps=defaults["eps"],
                                weight_decay=defaults["weight_decay"], amsgrad=defaults.get("amsgrad", False),
                                adamw_mode=isinstance(optimizer, torch.optim.AdamW))

    # ------------------------------------------------------------------------------ model access
    def apply_precision(self, model: nn.Module) -> None:
        """Nothing: the engine casts the model and scales the loss from the config's fp16/bf16 blocks."""

    def is_wrapped(self, model: nn.Module) -> bool:
        return type(model).__name__ == "DeepSpeedEngine"

    def _engine_of(self, model: nn.Module) -> Any:
        if self.is_wrapped(model):
            return model
        if self.engine is not None and self.engine.module is model:
            return self.engine
        return None

    def model_state_dict(self, model: nn.Module, *, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The full weights on every process; ZeRO-3 gathers them one layer at a time.

        Accelerate refuses ZeRO-3 weights unless ``zero3_save_16bit_model`` is set and returns them on
        rank 0 only; hasten always gathers (in the engine's dtype: 16-bit under fp16/bf16).
        """
        engine = self._engine_of(model)
        if engine is None or not engine.zero_optimization_partition_weights():
            return super().model_state_dict(model, unwrap=unwrap)
        state = _gather_zero3_state_dict(self.deepspeed, engine.module)
        return state if unwrap else {f"module.{k}": v for k, v in state.items()}

    # -------------------------------------------------------------------------------- the step
    def backward(self, loss: torch.Tensor, *, sync: bool = True, accumulation_steps: int = 1, **kwargs: Any) -> None:
        """``engine.backward(loss)`` (which divides by the config's accumulation steps itself), then on a
        synchronising micro-step (``sync``) ``engine.step()``: clipping, optimizer step, zero_grad."""
        if self.engine is None:
            raise ConfigurationError("accelerator.backward needs the prepared DeepSpeed model: call "
                                     "`accelerator.prepare(model, optimizer, loader)` first.")
        DeepSpeedEngineWrapper(self.engine).backward(loss, sync_gradients=sync, **kwargs)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any = None) -> bool:
        """Nothing to do (the engine stepped in ``backward``); False when that step overflowed (fp16)."""
        return not bool(getattr(optimizer, "overflow", False))

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool | None = None) -> None:
        """Nothing: the engine zeroes the gradients inside its step."""

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Nothing: the engine unscales inside its step."""

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> Any:
        """DeepSpeed clips inside ``engine.step`` (config ``gradient_clipping``); returns that step's norm."""
        norm = None if self.engine is None else self.engine.get_global_grad_norm()
        return torch.as_tensor(float(norm)) if norm is not None else None

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        raise ConfigurationError("clip_grad_value_ is not available with DeepSpeed, which clips by norm: set "
                                 "DeepSpeedPlugin(gradient_clipping=...) (or \"gradient_clipping\" in the config).")

    # ------------------------------------------------------------------------------ checkpoints
    def _engines(self, models: list[nn.Module]) -> list[tuple[str, Any]]:
        engines = [self._engine_of(m) for m in models]
        return [(MODEL_TAG if i == 0 else f"{MODEL_TAG}_{i}", e) for i, e in enumerate(x for x in engines if x)]

    def weights_for_save(self, models: list[nn.Module]) -> list[dict[str, torch.Tensor]]:
        """Nothing to show the pre-hooks: the engine writes its own checkpoint."""
        return []

    def engine_checkpoint_kwargs(self, call: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The extra ``save_state``/``load_state`` arguments, for ``engine.save_checkpoint``/``load_checkpoint``
        (as Accelerate passes them: ``client_state``, ``exclude_frozen_parameters``, ``load_optimizer_states``, ...).

        Raises:
            ConfigurationError: an argument the engine's function does not take (named, with those it takes).
        """
        from deepspeed.runtime.engine import DeepSpeedEngine as engine  # imported with the strategy
        function = engine.save_checkpoint if call == "save_state" else engine.load_checkpoint
        taken = [name for name in inspect.signature(function).parameters
                 if name not in ("self", "save_dir", "load_dir", "tag")]  # hasten chooses the folder and tag
        unknown = sorted(set(kwargs) - set(taken))
        if unknown:
            raise ConfigurationError(f"{call}() got keyword arguments DeepSpeed's engine.{function.__name__} does not "
                                     f"take: {', '.join(unknown)}. It takes {', '.join(taken)}.")
        return dict(kwargs)

    def save(self, models: list[nn.Module], optimizers: list[torch.optim.Optimizer], folder: Path, *,
             weights: list[dict[str, torch.Tensor]], writer: bool, safe_serialization: bool = True,
             sink: Sink, engine_kwargs: Mapping[str, Any] | None = None) -> None:
        """``engine.save_checkpoint(folder, "pytorch_model", **engine_kwargs)`` on every process (frozen models
        are not saved).

        The engine writes its files itself (``sink`` is unused): they are checksummed when the save is published.
        """
        options = self.engine_checkpoint_kwargs("save_state", engine_kwargs or {})
        for tag, engine in self._engines(models):
            engine.save_checkpoint(str(folder), tag=tag, **options)

    def check(self, models: list[nn.Module], optimizers: list[torch.optim.Optimizer], folder: Path, *,
              strict: bool = True, map_location: Any = "cpu") -> CheckedState:
        """The engine's folders exist, their files are safe, and they match the prepared engines (names,
        shapes, optimizer groups, counters: :mod:`~hasten.strategies.deepspeed_checks`), so the engine never
        fails half-way through its load; ZeRO shards of another count are converted on load
        (:mod:`hasten.checkpointing.universal`)."""
        universal: dict[str, int] = {}
        for tag, engine in self._engines(models):
            sub = Path(folder) / tag
            model_files = sorted(sub.glob("*model_states.pt")) if sub.is_dir() else []
            if not model_files:
                raise CheckpointError(f"{sub} holds no DeepSpeed model states: this checkpoint was not saved by "
                                      "DeepSpeed (or by another model count); load it without DeepSpeed.")
            ranks = len(list(sub.glob("*optim_states.pt")))
            if engine.zero_optimization() and ranks != self.num_processes:
                universal[tag] = ranks
            # DeepSpeed reads its files with weights_only=False: refuse any that names a non-allowed type.
            contents = check_deepspeed_files(sorted(sub.glob("*.pt")))
            check_engine_checkpoint(engine, model_files[0], contents[model_files[0]], ranks, strict=strict)
        return CheckedState(models=universal)  # the engine loads models and optimizers itself

    def load(self, models: list[nn.Module], optimizers: list[torch.optim.Optimizer], folder: Path,
             checked: CheckedState, *, strict: bool = True, engine_kwargs: Mapping[str, Any] | None = None) -> None:
        """``engine.load_checkpoint(..., load_module_strict=strict, **engine_kwargs)`` for every engine (from a
        universal conversion on another count)."""
        options = {"load_module_strict": strict, **self.engine_checkpoint_kwargs("load_state", engine_kwargs or {})}
        universal: dict[str, int] = checked.models or {}
        root = self._convert_to_universal(Path(folder), universal) if universal else None
        try:
            for tag, engine in self._engines(models):
                convert = root is not None and tag in universal
                source = root if convert and root is not None else Path(folder)
                previous = engine._config.load_universal_checkpoint
                engine._config.load_universal_checkpoint = convert
                try:
                    path, _ = engine.load_checkpoint(str(source), tag=tag, **options)
                finally:
                    engine._config.load_universal_checkpoint = previous
                if path is None:
                    raise CheckpointError(f"DeepSpeed could not load {Path(folder) / tag}.")
                if convert and root is not None and engine.zero_optimization_partition_weights():
                    from hasten.checkpointing.universal import repair_zero3_load

                    repair_zero3_load(engine.optimizer.optimizer, root / tag)
        finally:
            if root is not None:
                self._remove_conversion(root)

    def _convert_to_universal(self, folder: Path, universal: dict[str, int]) -> Path:
        """One process per machine converts into a temporary folder; every process learns the outcome."""
        import os
        import tempfile
        import uuid

        import torch.distributed as dist

        from hasten.checkpointing.universal import convert_to_universal

        name = [uuid.uuid4().hex]
        if dist.is_initialized():
            dist.broadcast_object_list(name, src=0)
        root = Path(tempfile.gettempdir()) / f"hasten-universal-{name[0]}"
        error = None
        if int(os.environ.get("LOCAL_RANK", dist.get_rank() if dist.is_initialized() else 0)) == 0:
            try:
                for tag in universal:
                    convert_to_universal(folder / tag, root / tag)
            except CheckpointError as exc:
                error = str(exc)
        errors = [error]
        if dist.is_initialized():
            errors = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error)
        failed = next((e for e in errors if e is not None), None)
        if failed is not None:
            self._remove_conversion(root)
            raise CheckpointError(failed)
        if not dist.is_initialized() or dist.get_rank() == 0:
            saved = ", ".join(f"{tag}: {ranks}" for tag, ranks in universal.items())
            warnings.warn(f"{folder} holds ZeRO shards of another number of processes ({saved}); converted them to "
                          f"DeepSpeed's universal checkpoint to load them into {self.num_processes}.", UserWarning,
                          stacklevel=2)
        return root

    @staticmethod
    def _remove_conversion(root: Path) -> None:
        import shutil

        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()  # every process has read it
        shutil.rmtree(root, ignore_errors=True)

    def accumulated_gradients(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Refused: the engine keeps partial gradients in its own partitioned buffers, outside its checkpoint.

        Raises:
            CheckpointError: always (save_state is refused before anything is written).
        """
        raise CheckpointError(
            "save_state was called inside a gradient-accumulation window (accelerator.sync_gradients is False), and "
            "DeepSpeed's checkpoint cannot hold the gradients accumulated so far: the resumed run would silently "
            "differ. Save on a synchronising step: `if accelerator.sync_gradients: accelerator.save_state(...)`.")


def _check_objects_against_config(config: dict[str, Any], optimizer: Any, scheduler: Any) -> None:
    if optimizer is not None:
        if "optimizer" in config and not isinstance(optimizer, DummyOptim):
            raise ConfigurationError("The DeepSpeed config defines an \"optimizer\" and prepare got a real one: remove "
                                     "the block from the config, or pass `DummyOptim(model.parameters(), lr=...)`.")
        if "optimizer" not in config and isinstance(optimizer, DummyOptim):
            raise ConfigurationError("DummyOptim needs an \"optimizer\" block in the DeepSpeed config; add one or pass "
                                     "a torch optimizer.")
    if scheduler is not None:
        if "scheduler" in config and not isinstance(scheduler, DummyScheduler):
            raise ConfigurationError("The DeepSpeed config defines a \"scheduler\" and prepare got a torch one: remove "
                                     "the block from the config, or pass `DummyScheduler(optimizer, ...)`.")
        if "scheduler" not in config and isinstance(scheduler, DummyScheduler) and scheduler.lr_scheduler_callable is None:
            raise ConfigurationError("DummyScheduler needs a \"scheduler\" block in the DeepSpeed config or "
                                     "`lr_scheduler_callable=`.")
        if isinstance(optimizer, DummyOptim) and not isinstance(scheduler, DummyScheduler):
            raise ConfigurationError("With DummyOptim the scheduler must be a DummyScheduler (the engine builds both).")


def _hidden_size_values(model: nn.Module, keys: list[str]) -> dict[str, int]:
    config: Any = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None)
    if hidden is None and getattr(config, "hidden_sizes", None):
        hidden = max(config.hidden_sizes)
    if hidden is None:
        raise ConfigurationError(f"DeepSpeed config keys {keys} are 'auto', which hasten fills from "
                                 "`model.config.hidden_size`; this model has none. Write numbers in the config.")
    return {_HIDDEN_SIZE_KEYS[0]: hidden * hidden, _HIDDEN_SIZE_KEYS[1]: int(0.9 * hidden * hidden),
            _HIDDEN_SIZE_KEYS[2]: 10 * hidden}


def _auto_keys(config: dict[str, Any], prefix: str = "") -> list[str]:
    found = []
    for key, value in config.items():
        if isinstance(value, dict):
            found += _auto_keys(value, f"{prefix}{key}.")
        elif value == "auto":
            found.append(prefix + key)
    return found


def _gather_zero3_state_dict(deepspeed: Any, module: nn.Module) -> dict[str, torch.Tensor]:
    """Every process gets every weight, gathering one module's parameters at a time (bounded memory)."""
    state: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}

    def visit(mod: nn.Module, prefix: str) -> None:
        params = list(mod.parameters(recurse=False))
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            for name, param in mod.named_parameters(recurse=False):
                key = prefix + name
                ident = getattr(param, "ds_id", id(param))
                state[key] = state[seen[ident]] if ident in seen else param.detach().cpu().clone()
                seen.setdefault(ident, key)
            for name, buf in mod.named_buffers(recurse=False):
                if buf is not None and name not in mod._non_persistent_buffers_set:
                    state[prefix + name] = buf.detach().cpu().clone()
        for name, child in mod.named_children():
            visit(child, f"{prefix}{name}.")

    visit(module, "")
    return state


__all__ = ["DeepSpeedStrategy", "import_deepspeed", "set_z3_leaf_modules_by_name", "zero3_init_context"]


class DeepSpeedEngineWrapper:
    """A DeepSpeed engine driven like a plain training loop (Accelerate's name): ``backward`` runs the
    engine's backward and, at the end of an accumulation cycle, its step (clipping, optimizer step,
    zero_grad, overflow check, engine-driven scheduler).

    Args:
        engine: a ``deepspeed.DeepSpeedEngine``.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def backward(self, loss: torch.Tensor, sync_gradients: bool = True, **kwargs: Any) -> None:
        """Backward through the engine; ``engine.step()`` only when ``sync_gradients``."""
        self.engine.set_gradient_accumulation_boundary(is_boundary=sync_gradients)
        self.engine.backward(loss, **kwargs)
        if sync_gradients:
            self.engine.step()

    def get_global_grad_norm(self) -> Any:
        """The engine's last global gradient norm, as a Python number when it is a tensor."""
        norm = self.engine.get_global_grad_norm()
        return norm.item() if hasattr(norm, "item") else norm
