"""``save_state`` / ``load_state`` / ``save_model`` and friends on the Accelerator.

**Every process must call ``save_state`` and ``load_state``** (not only the main process): they
synchronise, and each process saves and restores its own random generators.

The folder layout is Accelerate's (``model.safetensors``, ``optimizer.bin``, ``scheduler.bin``,
``scaler.pt``, ``random_states_{rank}.pkl``, ``custom_checkpoint_{i}.pkl``) plus
``dataloader_state{_i}.bin`` holding each prepared loader's epoch, shuffle generator and position,
and, for a save inside a gradient-accumulation window, ``accumulated_gradients{_i}_rank{r}.safetensors``
(the gradients gathered so far), so that the resumed run is bit-identical to an uninterrupted one.
A save becomes visible only when complete; a load checks every file before changing anything.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from hasten import ops
from hasten.accelerator._base import AcceleratorBase
from hasten.checkpointing import (
    CheckpointError,
    background,
    capture_rng_state,
    files as ckpt,
    restore_checks as checks,
    restore_rng_state,
    sealing,
)
from hasten.checkpointing.manifest import my_share, read_manifest, verify_files
from hasten.checkpointing.naming import (
    check_target,
    checkpoints_root,
    is_incomplete,
    iteration_of,
    newest_checkpoint,
    next_iteration,
    prepare_staging,
    prune,
    publish,
    recover,
    run_stage_hooks,
    staging_folder,
)
from hasten.checkpointing.rng import derive_rng_state
from hasten.checkpointing.shards import write_model_files
from hasten.checkpointing.transaction import Transaction
from hasten.state_helpers import writes_shared_files


class CheckpointMixin(AcceleratorBase):
    """Saving and restoring the whole training state."""

    _background_saver: background.BackgroundSaver | None = None  # created by the first async_save

    # ------------------------------------------------------------------------------------- saving
    def _checkpoint_target(self, output_dir: str | os.PathLike[str] | None) -> Path:
        config = self.project_configuration
        if config.automatic_checkpoint_naming:
            # Numbering continues after the highest checkpoint present (the main process's view counts).
            iteration = next_iteration(self.project_dir, config.iteration) if self.is_main_process else 0
            if self.num_processes > 1:
                iteration = ops.broadcast_object_list([iteration])[0]
            config.iteration = iteration
            return checkpoints_root(self.project_dir) / f"checkpoint_{config.iteration}"
        if output_dir is None:
            raise CheckpointError("save_state() needs `output_dir`, or "
                                  "`ProjectConfiguration(automatic_checkpoint_naming=True)` and a project_dir.")
        target = Path(os.path.abspath(Path(output_dir).expanduser()))  # "." and ".." have no name to stage beside
        # A symlinked folder (ckpt -> /scratch/...) stays a link: the save is staged and published beside its target.
        return Path(os.path.realpath(target)) if target.is_symlink() else target

    def _start_save(self, target: Path) -> None:
        """Main process: check, prune, create the staging folder; then everyone learns the outcome."""
        error = None
        if self.is_main_process:
            config = self.project_configuration
            try:
                if config.automatic_checkpoint_naming:
                    if target.exists():
                        raise CheckpointError(
                            f"Checkpoint directory {target} already exists. Load it first (load_state restores the "
                            "iteration) or set `accelerator.project_configuration.iteration` to a new number.")
                check_target(target)
                prepare_staging(target)
            except (OSError, CheckpointError) as exc:
                error = str(exc)
        outcome = ops.broadcast_object_list([error])[0]
        if outcome is not None:
            raise CheckpointError(outcome)
        staging_folder(target).mkdir(parents=True, exist_ok=True)  # other machines' local folders
        if self.is_main_process:
            run_stage_hooks("staged", staging_folder(target))

    def save_state(self, output_dir: str | os.PathLike[str] | None = None, safe_serialization: bool = True,
                   *, async_save: bool = False, **save_model_func_kwargs: Any) -> Path:
        """Save models, optimizers, schedulers, data loaders, scaler, RNGs and registered objects.

        With ``automatic_checkpoint_naming`` the folder is ``{project_dir}/checkpoints/checkpoint_{i}``
        (``output_dir`` is ignored) and old checkpoints beyond ``total_limit`` are removed.
        Call it on every process. ``async_save=True`` (hasten) returns once the state is serialised in
        host memory; writing and publication finish in the background (:meth:`wait_for_checkpoint`).

        Returns:
            The checkpoint folder.
        """
        self.wait_for_checkpoint()  # at most one save in flight; raises the failure of the previous one
        target = self._checkpoint_target(output_dir)
        # Inside an accumulation window the gradients gathered so far are part of the state. They are
        # captured first: a strategy that cannot keep them refuses here, before anything is written.
        gradients = [] if self.sync_gradients else [self._strategy.accumulated_gradients(m) for m in self._models]
        self._start_save(target)
        staging = staging_folder(target)
        if async_save:
            return self._save_in_background(target, staging, gradients, safe_serialization)
        sealer = sealing.start(staging)  # each file checksummed as written, fsync'ed in the background
        try:
            self._write_state(staging, gradients, safe_serialization)
            sealed = sealer.finish()  # this process's files are durable before the others are told so
        finally:
            sealing.stop(staging)
        run_stage_hooks("before_publish", staging)
        self.wait_for_everyone()
        if self.is_main_process:
            publish(target, self.num_processes, sealed)
        self.wait_for_everyone()
        if self.is_local_main_process and not self.is_main_process:
            publish(target, self.num_processes, sealed)  # machines that do not share the main process's file system
        self.wait_for_everyone()
        if self.is_main_process and self.project_configuration.automatic_checkpoint_naming:
            run_stage_hooks("published", target)
            prune(target.parent, self.project_configuration.total_limit, keep=target)  # only now: never zero checkpoints
        self.project_configuration.iteration += 1
        return target

    def _write_state(self, staging: Path, gradients: list[dict[str, torch.Tensor]], safe_serialization: bool) -> None:
        weights = self._strategy.weights_for_save(self._models)
        for hook in self._save_model_state_pre_hook.values():
            hook(self._models, weights, str(staging))
        self._strategy.save(self._models, self._raw_optimizers(), staging, weights=weights,
                            writer=self._writes_shared_files(), safe_serialization=safe_serialization)
        if self._writes_shared_files():
            self._write_shared_files(staging)
        ckpt.torch_save(capture_rng_state(self.step), staging / ckpt.RNG.format(rank=self.process_index))
        self._save_accumulated_gradients(staging, gradients)

    def _save_in_background(self, target: Path, staging: Path, gradients: list[dict[str, torch.Tensor]],
                            safe_serialization: bool) -> Path:
        if self._background_saver is None:  # collective: every process creates the side group together
            self._background_saver = background.BackgroundSaver(
                background.Coordinator.create(self.num_processes, self.process_index))
        with background.capture(staging, self._background_saver.buffers) as snapshot:
            self._write_state(staging, gradients, safe_serialization)
        config = self.project_configuration
        self._background_saver.submit(snapshot, background.Publication(
            target, staging, self.num_processes, self.is_main_process, self.is_local_main_process,
            config.total_limit, bool(config.automatic_checkpoint_naming)))
        config.iteration += 1
        return target

    def wait_for_checkpoint(self) -> None:
        """Wait until the save started with ``save_state(..., async_save=True)`` is published (hasten).

        Raises:
            CheckpointError: the background save failed; the same message on every process, naming
                the process and the file. The previous checkpoint is then intact.
        """
        if self._background_saver is not None:
            self._background_saver.wait()

    def _save_accumulated_gradients(self, folder: Path, gradients: list[dict[str, torch.Tensor]]) -> None:
        # Each process's own (they differ under no_sync), or the next optimizer step after resuming would differ.
        for i, grads in enumerate(gradients):
            if grads:
                path = folder / ckpt.GRADIENTS.format(suffix=ckpt.suffix(i), rank=self.process_index)
                ckpt.save_gradient_tensors(grads, path)

    def _writes_shared_files(self) -> bool:
        return writes_shared_files(self.project_configuration.save_on_each_node)  # the one rule (state_helpers)

    def _write_shared_files(self, folder: Path) -> None:
        """What is not model or optimizer state (the strategy writes those): schedulers, loaders, scaler, objects."""
        for i, scheduler in enumerate(self._schedulers):
            ckpt.torch_save(scheduler.state_dict(), folder / ckpt.SCHEDULER.format(suffix=ckpt.suffix(i)))
        for i, loader in enumerate(self._dataloaders):
            if hasattr(loader, "state_dict"):
                ckpt.torch_save(loader.state_dict(), folder / ckpt.DATALOADER.format(suffix=ckpt.suffix(i)))
        scaler_state = self._precision.state_dict()
        if scaler_state is not None:
            ckpt.torch_save(scaler_state, folder / ckpt.SCALER)
        for i, obj in enumerate(self._custom_objects):
            ckpt.torch_save(obj.state_dict(), folder / ckpt.CUSTOM.format(index=i))

    # ------------------------------------------------------------------------------------ loading
    def _resolve_load_folder(self, input_dir: str | os.PathLike[str] | None) -> Path:
        if input_dir is None:
            if not self.project_configuration.automatic_checkpoint_naming:
                raise CheckpointError("load_state() needs `input_dir`, or automatic checkpoint naming to find "
                                      "the newest checkpoint.")
            newest = newest_checkpoint(self.project_dir)
            if newest is None:
                raise CheckpointError(f"No complete checkpoint under {checkpoints_root(self.project_dir)}.")
            return newest
        folder = Path(os.path.abspath(Path(input_dir).expanduser()))
        recover(folder)  # a save that died between the renames of the fallback publication
        if not folder.is_dir():
            raise CheckpointError(f"Checkpoint folder {folder} does not exist (or is not a folder).")
        if is_incomplete(folder):
            raise CheckpointError(f"{folder} holds an unfinished save (it was interrupted); load another checkpoint.")
        return folder

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

        Raises:
            CheckpointError: a missing folder or file, a damaged file, or a folder that does not match
                what was prepared (models, optimizers, registered objects, number of processes); raised
                with the same message on every process, before anything changed.
        """
        self.wait_for_checkpoint()
        folder = self._resolve_load_folder(input_dir)
        for hook in self._load_model_state_pre_hook.values():
            hook(self._models, str(folder))
        strict = bool(load_model_func_kwargs.pop("strict", True))
        map_location = self._map_location(load_model_func_kwargs.pop("map_location", None))
        verify = bool(load_model_func_kwargs.pop("verify_checksums", True))
        plan = self._agree(lambda: self._read_checkpoint(folder, strict, map_location, verify))
        if plan.get("warning") and self.is_main_process:
            warnings.warn(plan["warning"], UserWarning, stacklevel=2)
        self._apply_checkpoint(plan, strict, folder)
        iteration = iteration_of(folder)
        if self.project_configuration.automatic_checkpoint_naming and iteration is not None:
            self.project_configuration.iteration = iteration + 1
        self.wait_for_everyone()
        return folder

    def _map_location(self, value: Any) -> Any:
        if value in (None, "cpu"):
            return "cpu"
        if value == "on_device":
            return self.device
        raise CheckpointError(f"load_state(map_location={value!r}): use None, 'cpu' or 'on_device'.")

    def _agree(self, read: Any) -> dict[str, Any]:
        """Run the read phase on every process; if any process fails, every process raises its error."""
        plan, error = None, None
        try:
            plan = read()
        except Exception as exc:  # noqa: BLE001 - shared with the other processes, then raised
            error = exc
        self._raise_if_any_failed(error)
        assert plan is not None
        return plan

    def _raise_if_any_failed(self, error: BaseException | None) -> None:
        """Share each process's outcome; if any failed, raise the first failure's message on every process."""
        message = None
        if error is not None:
            message = str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"
            message = message.removeprefix("load_state: ")
        messages = ops.gather_object([message]) if self.num_processes > 1 else [message]
        failed = [(rank, text) for rank, text in enumerate(messages) if text is not None]
        if failed:
            rank, text = failed[0]
            prefix = "" if self.num_processes == 1 else f"process {rank}: "
            raise CheckpointError(f"load_state: {prefix}{text}") from error

    def _read_checkpoint(self, folder: Path, strict: bool, map_location: Any, verify: bool = True) -> dict[str, Any]:
        plan: dict[str, Any] = {"schedulers": [], "loaders": [], "custom": []}
        manifest = read_manifest(folder)
        if manifest is not None and verify:  # the node's processes split the files between them
            local_world = int(getattr(self.state, "num_local_processes", 1) or 1)
            verify_files(folder, manifest, my_share(sorted(manifest["files"]), self.local_process_index, local_world))
        plan["strategy"] = self._strategy.check(self._models, self._raw_optimizers(), folder, strict=strict,
                                                map_location=map_location)
        for i, _ in enumerate(self._schedulers):
            plan["schedulers"].append(ckpt.torch_load(folder / ckpt.SCHEDULER.format(suffix=ckpt.suffix(i))))
        saved_loaders = ckpt.count_files(folder, "dataloader_state")
        if saved_loaders and saved_loaders != len(self._dataloaders):
            raise CheckpointError(f"{folder} holds the state of {saved_loaders} data loaders but {len(self._dataloaders)} "
                                  "are prepared; prepare the same loaders, in the same order, before load_state.")
        for i in range(saved_loaders):
            plan["loaders"].append(ckpt.torch_load(folder / ckpt.DATALOADER.format(suffix=ckpt.suffix(i))))
        saved_custom = ckpt.count_files(folder, "custom_checkpoint_")
        if saved_custom != len(self._custom_objects):
            raise CheckpointError(f"{folder} holds {saved_custom} registered objects but {len(self._custom_objects)} "
                                  "are registered with register_for_checkpointing; register the same objects.")
        for i in range(saved_custom):
            plan["custom"].append(ckpt.load_registered_state(folder / ckpt.CUSTOM.format(index=i)))
        if self._precision.scaler is not None and (folder / ckpt.SCALER).is_file():
            plan["scaler"] = ckpt.torch_load(folder / ckpt.SCALER)
        plan["warning"] = checks.check_process_count(folder, manifest, self.num_processes, plan["loaders"])
        checks.check_loader_states(folder, self._dataloaders, plan["loaders"])
        rng_path, derive = checks.rng_source(folder, manifest, self.process_index, self.num_processes)
        if not rng_path.is_file():
            raise CheckpointError(checks.missing_rng_message(folder, rng_path, manifest, self.process_index,
                                                             self.num_processes))
        plan["rng"] = (rng_path, ckpt.load_rng_file(rng_path))  # Accelerate's files hold NumPy states
        if derive:  # a process the saving run did not have (documented rule in derive_rng_state)
            plan["rng"] = (rng_path, derive_rng_state(plan["rng"][1], self.process_index))
        checks.check_rng_state(plan["rng"][1], rng_path)
        plan["gradients"] = []
        for i, _ in enumerate(self._models):
            path = folder / ckpt.GRADIENTS.format(suffix=ckpt.suffix(i), rank=self.process_index)
            plan["gradients"].append((path, ckpt.read_gradients(path)) if path.is_file() else None)
        return plan

    def _raw_optimizers(self) -> list[Any]:
        return [getattr(opt, "optimizer", opt) for opt in self._optimizers]

    def _apply_checkpoint(self, plan: dict[str, Any], strict: bool, folder: Path) -> None:
        # Everything was read and checked; apply the small states first, each with an undo, so a
        # failure (a registered object refusing its state) puts back what was already restored. The
        # processes agree after the small states (before the models, whose loading may be collective)
        # and again at the end: a failure on any process is undone and raised on every process.
        tx = Transaction(folder)
        self._agreed_step(tx, lambda: self._apply_small_states(tx, plan))
        self._agreed_step(tx, lambda: self._apply_models_and_generators(tx, plan, strict, folder))
        self.gradient_state._set_sync_gradients(self.step % self.gradient_state.num_steps == 0)

    def _agreed_step(self, tx: Transaction, action: Any) -> None:
        error = None
        try:
            action()
        except Exception as exc:  # noqa: BLE001 - shared with the other processes, then raised
            error = exc
        try:
            self._raise_if_any_failed(error)
        except CheckpointError:
            tx.undo()
            raise

    def _apply_small_states(self, tx: Transaction, plan: dict[str, Any]) -> None:
        if "scaler" in plan:
            tx.apply("the loss scaler", self._precision, plan["scaler"])
        for i, (optimizer, state) in enumerate(zip(self._optimizers, plan["strategy"].optimizer_states)):
            tx.apply(f"optimizer #{i}", optimizer, state)
        for i, (scheduler, state) in enumerate(zip(self._schedulers, plan["schedulers"])):
            tx.apply(f"scheduler #{i}", scheduler, state)
        for i, (loader, state) in enumerate(zip(self._dataloaders, plan["loaders"])):
            tx.apply(f"data loader #{i}", loader, state)
        for i, (obj, state) in enumerate(zip(self._custom_objects, plan["custom"])):
            tx.apply(f"registered object #{i} ({type(obj).__name__})", obj, state)

    def _apply_models_and_generators(self, tx: Transaction, plan: dict[str, Any], strict: bool, folder: Path) -> None:
        tx.run("the models", lambda: self._load_models(plan, strict, folder))
        path, rng = plan["rng"]
        step, generators = self.step, capture_rng_state(self.step)

        def put_back() -> None:
            restore_rng_state(generators, path)
            self.step = step

        tx.on_undo(put_back)
        self.step = restore_rng_state(rng, path)

    def _load_models(self, plan: dict[str, Any], strict: bool, folder: Path) -> None:
        """Last, once every small state is in: what the strategy loads itself, then accumulated gradients."""
        self._strategy.load(self._models, self._raw_optimizers(), folder, plan["strategy"], strict=strict)
        for model, saved in zip(self._models, plan["gradients"]):
            if saved is not None:
                self._strategy.restore_accumulated_gradients(model, saved[1], saved[0])

    # ------------------------------------------------------------------------------- other helpers
    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The model's full state dict (unwrapped: no ``module.`` prefix). Call it on every process."""
        return self._strategy.model_state_dict(model, unwrap=unwrap)

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
