"""``Accelerator.prepare`` and its per-type helpers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hasten.accelerator._base import AcceleratorBase
from hasten.exceptions import ConfigurationError
from hasten.optim import AcceleratedOptimizer, AcceleratedScheduler

_SCHEDULER_TYPES: tuple[type, ...] = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def _multi_device_map(model: nn.Module) -> bool:
    device_map = getattr(model, "hf_device_map", None)
    return isinstance(device_map, dict) and len(set(map(str, device_map.values()))) > 1


class PrepareMixin(AcceleratorBase):
    """Wraps models, optimizers, schedulers and data loaders for the current strategy."""

    def prepare(self, *args: Any, device_placement: list[bool] | None = None,
                loss_fn: Callable[..., Any] | None = None) -> Any:
        """Prepare objects for training; returns them in the same order (one object if one was given).

        Models are placed and wrapped (DDP when distributed), optimizers become
        ``AcceleratedOptimizer``, schedulers ``AcceleratedScheduler``, data loaders are sharded;
        anything else is returned unchanged.

        Args:
            *args: models, optimizers, schedulers, data loaders, in any order.
            device_placement: one bool per object to override ``Accelerator(device_placement=...)``.
            loss_fn: hasten, pipeline parallelism only: ``loss_fn(output, labels)``, the loss the last stage
                computes per micro-batch (without it, the model's own loss from ``labels``).

        Example:
            >>> model, optimizer, train_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, scheduler)
        """
        # Accelerate reads the shared state first: after ``AcceleratorState._reset_state()`` this raises
        # its AttributeError naming ``_reset_state`` instead of preparing against a cleared state.
        _ = self.state.distributed_type
        if device_placement is None:
            device_placement = [None] * len(args)  # type: ignore[list-item]
        elif len(device_placement) != len(args):
            raise ConfigurationError(f"prepare got {len(args)} objects but device_placement has "
                                     f"{len(device_placement)} entries; give one bool per object.")
        if loss_fn is not None:
            self._strategy.set_loss_fn(loss_fn)
        args = self._prepare_models_and_optimizers(args, device_placement)
        first = [self._prepare_first_pass(obj, placement) for obj, placement in zip(args, device_placement)]
        result = tuple(self._prepare_scheduler_pass(obj) for obj in first)
        for obj in result:  # as Accelerate marks what prepare() returns (models and loaders already are)
            if any(obj is kept for kept in (*self._optimizers, *self._schedulers)):
                obj._is_accelerate_prepared = True
        if self._optimizers and self._fault_tolerance is None:  # type: ignore[attr-defined]
            # A training run: a preemption signal now stops it at a common step. Not under replica groups: there
            # the signal (torchrun's agent stopping a group whose process died) must end the process at once, or
            # its torchft Manager keeps the lost group alive in the Lighthouse's view and holds up the
            # survivors' quorum (docs/fault-tolerance.md, "When a process fails").
            self._arm_preemption()  # type: ignore[attr-defined]
        if self._optimizers and self._fault_tolerance is not None:  # type: ignore[attr-defined]
            self._attach_replica_group()  # type: ignore[attr-defined]  # joins (and heals at) the first quorum
        return result[0] if len(result) == 1 else result

    def _prepare_models_and_optimizers(self, args: tuple[Any, ...], placements: list[Any]) -> tuple[Any, ...]:
        """The call's models and optimizers go to the strategy together (sharding re-points optimizers)."""
        models = [i for i, obj in enumerate(args) if isinstance(obj, nn.Module) and not self._already_prepared(obj)]
        if not models:
            return args
        optimizers = [i for i, obj in enumerate(args) if isinstance(obj, torch.optim.Optimizer)
                      and not isinstance(obj, AcceleratedOptimizer)]
        self._strategy.observe_prepare_call(args, split_batches=self.split_batches)
        prepared = self._prepare_models([args[i] for i in models], [placements[i] for i in models],
                                        [args[i] for i in optimizers])
        result = list(args)
        for i, model in zip(models, prepared[0]):
            result[i] = model
        for i, optimizer in zip(optimizers, prepared[1]):
            result[i] = self.prepare_optimizer(optimizer, device_placement=placements[i])
        return tuple(result)

    def _already_prepared(self, model: nn.Module) -> bool:
        if getattr(model, "_is_accelerate_prepared", False) or self._strategy.is_wrapped(model):
            if model not in self._models:
                self._models.append(model)
            return True
        return False

    def _prepare_models(self, models: list[nn.Module], placements: list[bool | None],
                        optimizers: list[torch.optim.Optimizer], evaluation_mode: bool = False,
                        ) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
        """One strategy call for the models (and their optimizers), then ``torch.compile`` once, after it."""
        resolved = []
        for model, placement in zip(models, placements):
            placement = self.device_placement if placement is None else placement
            if _multi_device_map(model):
                if self.use_distributed:
                    raise ConfigurationError(
                        "You can't train a model that has been loaded with `device_map='auto'` in any distributed "
                        "mode: it spans several devices. HINT: load it with `device_map={'': "
                        "accelerator.local_process_index}` (one full copy per process), or shard it with "
                        "FSDP2/DeepSpeed.")
                placement = False  # its layers already sit where the map put them
            resolved.append(placement)
        prepared, new_optimizers = self._strategy.prepare(
            models, optimizers, device_placement=resolved, evaluation_mode=evaluation_mode,
            accumulation_steps=self.gradient_accumulation_steps)
        steps = self._strategy.accumulation_steps(self.gradient_accumulation_steps)
        if steps != self.gradient_accumulation_steps:  # the engine's configured count wins
            self.gradient_accumulation_steps = steps
        compiled = []
        for model in prepared:
            if self._settings.dynamo_backend != "NO":
                model = self._strategy.compile(model, self._settings.dynamo_backend.lower(),
                                               dict(self._settings.dynamo_kwargs))
            setattr(model, "_is_accelerate_prepared", True)  # noqa: B010 - nn.Module's typed __setattr__
            self._models.append(model)
            compiled.append(model)
        return compiled, new_optimizers

    def _prepare_first_pass(self, obj: Any, placement: bool | None) -> Any:
        if isinstance(obj, torch.utils.data.DataLoader):
            return self.prepare_data_loader(obj, device_placement=placement)
        if isinstance(obj, torch.optim.Optimizer):
            return self.prepare_optimizer(obj, device_placement=placement)
        return obj

    def _prepare_scheduler_pass(self, obj: Any) -> Any:
        if isinstance(obj, _SCHEDULER_TYPES):
            return self.prepare_scheduler(obj)
        return obj

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> nn.Module:
        """Place ``model`` on the device, add mixed precision, wrap it for the strategy, compile it if asked.

        A model already prepared (or already wrapped by the strategy) is returned as it is.

        Args:
            model: the model.
            device_placement: move it to ``accelerator.device`` (default: the Accelerator's setting).
            evaluation_mode: for inference only: no DDP/FSDP2/DeepSpeed wrapper.
        """
        if self._already_prepared(model):
            return model
        return self._prepare_models([model], [device_placement], [], evaluation_mode=evaluation_mode)[0][0]

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> AcceleratedOptimizer:
        """Wrap ``optimizer`` so it follows gradient accumulation and fp16 loss scaling."""
        if isinstance(optimizer, AcceleratedOptimizer):
            if optimizer not in self._optimizers:
                self._optimizers.append(optimizer)
            return optimizer
        placement = self.device_placement if device_placement is None else device_placement
        if placement:
            self._strategy.place_optimizer_state(optimizer)
        self._precision.setup_optimizer(optimizer)
        prepared = AcceleratedOptimizer(optimizer, device_placement=placement, scaler=self._precision.scaler,
                                        strategy=self._strategy)
        self._optimizers.append(prepared)
        return prepared

    def prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        """Wrap a learning-rate scheduler so it steps with its optimizer (see ``hasten.optim``)."""
        if isinstance(scheduler, AcceleratedScheduler):
            return scheduler
        inner = getattr(scheduler, "optimizer", None)
        optimizers = [opt for opt in self._optimizers if opt.optimizer is inner or opt is inner] or self._optimizers
        prepared = AcceleratedScheduler(scheduler, optimizers, step_with_optimizer=self.step_scheduler_with_optimizer,
                                        split_batches=self.split_batches)
        self._schedulers.append(prepared)
        return prepared

    def prepare_data_loader(self, data_loader: torch.utils.data.DataLoader, device_placement: bool | None = None,
                            slice_fn_for_dispatch: Any = None) -> torch.utils.data.DataLoader:
        """Shard ``data_loader`` across processes and move its batches to the device."""
        if getattr(data_loader, "_is_accelerate_prepared", False):
            if data_loader not in self._dataloaders:
                self._dataloaders.append(data_loader)
            return data_loader
        placement = self.device_placement if device_placement is None else device_placement
        if self._fault_tolerance is not None:  # type: ignore[attr-defined]  # batches at the groups' global cursor
            # ... when training; an evaluation pass reads the sharded loader over this group's processes.
            evaluation = self._shard_data_loader(data_loader, placement, slice_fn_for_dispatch)
            ft_loader = self._replica_group_loader(data_loader, placement, evaluation)  # type: ignore[attr-defined]
            self._dataloaders.append(ft_loader)
            return ft_loader  # type: ignore[no-any-return]
        prepared = self._shard_data_loader(data_loader, placement, slice_fn_for_dispatch)
        self._dataloaders.append(prepared)
        return prepared

    def _shard_data_loader(self, data_loader: torch.utils.data.DataLoader, placement: bool,
                           slice_fn_for_dispatch: Any) -> torch.utils.data.DataLoader:
        """``data_loader`` sharded over the data-parallel processes (of this replica group, under fault tolerance)."""
        from hasten.data import prepare_data_loader

        config = self.dataloader_config
        # Under tensor/context parallelism the ranks of one group read the same batches.
        num_shards, shard_index = self._data_parallel_position()
        prepared = prepare_data_loader(
            data_loader, device=self.device, num_processes=num_shards, process_index=shard_index,
            split_batches=config.split_batches, put_on_device=placement, rng_types=list(self.rng_types),
            dispatch_batches=config.dispatch_batches, even_batches=config.even_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch, use_seedable_sampler=config.use_seedable_sampler,
            data_seed=config.data_seed, non_blocking=config.non_blocking,
            use_stateful_dataloader=config.use_stateful_dataloader)
        prepared._is_accelerate_prepared = True
        return prepared
