"""``save_state`` / ``load_state`` / ``save_model`` and friends on the Accelerator.

**Every process must call ``save_state`` and ``load_state``** (not only the main process): they
synchronise, and each process saves and restores its own random generators. Under replica groups
(``hasten launch --replica_groups N``) one live group writes each checkpoint and the others skip the save
(:func:`hasten.accelerator._fault_tolerance.skips_checkpoint_writes`); every group can load it.

The protocol (layout, staging, sealing, publication, rotation; checks, then apply with undo) belongs
to :class:`hasten.checkpointing.manager.CheckpointManager`; this mixin hands it the Accelerator's objects.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from hasten.accelerator._base import AcceleratorBase
from hasten.accelerator._fault_tolerance import skips_checkpoint_writes
from hasten.accelerator._preemption import no_stop_inside
from hasten.accelerator_state_files import check_load_kwargs
from hasten.checkpointing import write_model_files
from hasten.checkpointing.manager import CheckpointManager, Ranks, TrainingObjects
from hasten.checkpointing.naming import checkpoints_root
from hasten.state_helpers import writes_shared_files


class CheckpointMixin(AcceleratorBase):
    """Saving and restoring the whole training state."""

    _checkpoints: CheckpointManager | None = None  # made at the first save, load or wait

    def _checkpoint_manager(self) -> CheckpointManager:
        if self._checkpoints is None:
            ranks = Ranks(self.num_processes, self.process_index, self.local_process_index,
                          int(getattr(self.state, "num_local_processes", 1) or 1))
            self._checkpoints = CheckpointManager(self._strategy, ranks, device=self.device)
        return self._checkpoints

    def _training_objects(self) -> TrainingObjects:
        return TrainingObjects(
            models=self._models, optimizers=self._optimizers, schedulers=self._schedulers,
            dataloaders=self._dataloaders, custom_objects=self._custom_objects,
            scaler=self._precision if self._precision.scaler is not None else None, step=self.step,
            accumulating=not self.sync_gradients, save_hooks=list(self._save_model_state_pre_hook.values()),
            load_hooks=list(self._load_model_state_pre_hook.values()))

    @property
    def _background_saver(self) -> Any:  # the asynchronous saves' keeper (None before the first); benchmarks poll it
        return self._checkpoints.background if self._checkpoints is not None else None

    @no_stop_inside
    def save_state(self, output_dir: str | os.PathLike[str] | None = None, safe_serialization: bool = True,
                   *, async_save: bool = False, **save_model_func_kwargs: Any) -> Path:
        """Save models, optimizers, schedulers, data loaders, scaler, RNGs and registered objects.

        With ``automatic_checkpoint_naming`` the folder is ``{project_dir}/checkpoints/checkpoint_{i}``
        (``output_dir`` is ignored) and old checkpoints beyond ``total_limit`` are removed.
        Call it on every process. ``async_save=True`` (hasten) returns once the state is serialised in
        host memory; writing and publication finish in the background (:meth:`wait_for_checkpoint`).
        ``save_model_func_kwargs`` go, as in Accelerate, to DeepSpeed's ``engine.save_checkpoint``
        (``client_state``, ``save_latest``, ``exclude_frozen_parameters``); without DeepSpeed they are refused.

        Returns:
            The checkpoint folder.

        Raises:
            ConfigurationError: a keyword argument nothing would use (named), before anything is written.
            CheckpointError: the save failed on some process: the same message on every process.
        """
        if skips_checkpoint_writes(self):  # replica groups: another live group writes this checkpoint
            return self._checkpoint_written_elsewhere(output_dir, save_model_func_kwargs)
        return self._checkpoint_manager().save(
            self._training_objects(), output_dir, config=self.project_configuration, writer=self._writes_shared_files(),
            safe_serialization=safe_serialization, async_save=async_save, engine_kwargs=save_model_func_kwargs)

    def _checkpoint_written_elsewhere(self, output_dir: str | os.PathLike[str] | None,
                                      engine_kwargs: dict[str, Any]) -> Path:
        """``save_state`` on a replica group that does not write: the same checks and counter, no file, no
        collective; the folder the writing group publishes (under automatic naming, the one this counter names)."""
        manager = self._checkpoint_manager()
        manager.wait()
        manager.models.engine_checkpoint_kwargs("save_state", engine_kwargs)
        config = self.project_configuration
        if not config.automatic_checkpoint_naming:
            return manager._target(output_dir, config)  # no disk read and no collective without automatic naming
        target = checkpoints_root(config.project_dir) / f"checkpoint_{config.iteration}"
        config.iteration += 1
        return target

    def wait_for_checkpoint(self) -> None:
        """Wait until the save started with ``save_state(..., async_save=True)`` is published (hasten).

        Raises:
            CheckpointError: the background save failed; the same message on every process, naming
                the process and the file. The previous checkpoint is then intact.
        """
        if self._checkpoints is not None:
            self._checkpoints.wait()

    def _writes_shared_files(self) -> bool:
        if skips_checkpoint_writes(self):  # replica groups: one group writes what all of them hold
            return False
        return writes_shared_files(self.project_configuration.save_on_each_node)  # the one rule (state_helpers)

    @no_stop_inside
    def load_state(self, input_dir: str | os.PathLike[str] | None = None, load_kwargs: dict[str, Any] | None = None,
                   **load_model_func_kwargs: Any) -> Path:
        """Restore what :meth:`save_state` saved; every file is checked before anything changes.

        With ``input_dir=None`` and automatic naming, the newest complete checkpoint is loaded and the
        iteration counter continues after it. Prepared data loaders resume at the saved position.
        Call it on every process.

        Every file listed in the checkpoint's manifest is checked against its recorded size and CRC-32
        first; pass ``verify_checksums=False`` to skip that (trusted storage). A checkpoint saved by
        another number of processes loads with a warning naming the random states it drops or derives;
        data loaders continue at the saved global sample (docs/checkpointing.md).

        As in Accelerate, ``strict`` goes to the models' loading and ``load_kwargs`` are the options of
        reading optimizer and scheduler files (hasten honours ``{"weights_only": True}``, its own way);
        the other ``load_model_func_kwargs`` go to DeepSpeed's ``engine.load_checkpoint``
        (``load_optimizer_states``, ``load_module_only``, ...); without DeepSpeed they are refused.

        Raises:
            ConfigurationError: a keyword argument or ``load_kwargs`` option nothing would use (named),
                before anything is read.
            CheckpointError: a missing folder or file, a damaged file, or a folder that does not match
                what was prepared (models, optimizers, registered objects, number of processes); raised
                with the same message on every process, before anything changed.
        """
        check_load_kwargs("load_state", load_kwargs)
        options = dict(load_model_func_kwargs)
        folder, step = self._checkpoint_manager().load(
            self._training_objects(), input_dir, config=self.project_configuration,
            strict=bool(options.pop("strict", True)), map_location=options.pop("map_location", None),
            verify_checksums=bool(options.pop("verify_checksums", True)), engine_kwargs=options)
        self.step = step
        self.gradient_state._set_sync_gradients(self.step % self.gradient_state.num_steps == 0)
        return folder

    # ------------------------------------------------------------------------------- other helpers
    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The model's full state dict (unwrapped: no ``module.`` prefix). Call it on every process."""
        return self._strategy.model_state_dict(model, unwrap=unwrap)

    @no_stop_inside
    def save_model(self, model: torch.nn.Module, save_directory: str | os.PathLike[str],
                   max_shard_size: int | str = "10GB", safe_serialization: bool = True) -> None:
        """Save the model's weights: ``model.safetensors``, or shards + ``model.safetensors.index.json``.

        Shards of an earlier save into the same folder are removed. Call it on every process; the
        main process writes.
        """
        from hasten.big_modeling.extras import get_state_dict_offloaded_model
        from hasten.big_modeling.tensors import has_offloaded_params

        if any(has_offloaded_params(module) for module in model.modules()):
            state = get_state_dict_offloaded_model(model)  # dispatched with offload: weights live in the hooks
        else:
            state = self.get_state_dict(model)
        if self._writes_shared_files():
            write_model_files(state, save_directory, max_shard_size=max_shard_size,
                              safe_serialization=safe_serialization)
        self.wait_for_everyone()

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Also save and restore these objects (each needs ``state_dict`` and ``load_state_dict``)."""
        invalid = [obj for obj in objects if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"))]
        if invalid:
            raise ValueError(f"register_for_checkpointing: these objects lack `state_dict`/`load_state_dict`: "
                             f"{[type(o).__name__ for o in invalid]}")
        self._custom_objects.extend(objects)

    def register_save_state_pre_hook(self, hook: Any) -> RemovableHandle:
        """Run ``hook(models, weights, output_dir)`` before models are written; it may edit ``weights``."""
        handle = RemovableHandle(self._save_model_state_pre_hook)
        self._save_model_state_pre_hook[handle.id] = hook
        return handle

    def register_load_state_pre_hook(self, hook: Any) -> RemovableHandle:
        """Run ``hook(models, input_dir)`` before a checkpoint is loaded."""
        handle = RemovableHandle(self._load_model_state_pre_hook)
        self._load_model_state_pre_hook[handle.id] = hook
        return handle
