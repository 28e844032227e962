"""The checkpoint protocol's one owner: :class:`CheckpointManager`.

It is given the stateful objects of a run (:class:`TrainingObjects`: models and optimizers, whose
state the strategy writes and reads, schedulers, data loaders, the loss scaler, registered objects,
and the step counter saved with each process's random generators) and owns every step of a save
and a load; the ``Accelerator`` only collects the objects and calls it.

Save (every process): choose the folder (automatic naming continues after the highest checkpoint
present), check and clear the staging folder ``<folder>.tmp`` on the main process, write into it (the
strategy's model and optimizer files, then the files below), CRC-32 and fsync each file as it is
written (the :class:`~hasten.checkpointing.sinks.SealedSink` made for this save is handed to every
writer), then, once every process's files are durable, publish the folder atomically and prune to
``total_limit``. With ``async_save`` the writers are handed a
:class:`~hasten.checkpointing.background.SnapshotSink` instead, which stages the states in host
memory; :mod:`hasten.checkpointing.background` writes, seals and publishes them in a thread.

Load (every process): find the folder, read and check everything first (the manifest's checksums,
the strategy's ``check``, the files below, the process count, the random generator states); any
failure on any process is raised on every process before anything changed. Then apply the small
states, each with an undo (:class:`~hasten.checkpointing.transaction.Transaction`), and last the
strategy's ``load`` and the generators; a failure anywhere puts back what was applied.

Files besides the strategy's (Accelerate's names): ``scheduler{_i}.bin``, ``dataloader_state{_i}.bin``,
``scaler.pt``, ``custom_checkpoint_{i}.pkl`` (written by the process that writes shared files),
``random_states_{rank}.pkl`` and, inside an accumulation window,
``accumulated_gradients{_i}_rank{r}.safetensors`` (every process its own).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from hasten.base.dataclasses import ProjectConfiguration
from hasten.checkpointing import background, files as ckpt, restore_checks as checks
from hasten.checkpointing.manifest import my_share, read_manifest, verify_files
from hasten.checkpointing.naming import (
    checkpoints_root,
    iteration_of,
    newest_checkpoint,
    next_iteration,
    run_stage_hooks,
)
from hasten.checkpointing.publication import (
    Publication,
    agree_on_default_group,
    attempt,
    check_target,
    is_incomplete,
    prepare_staging,
    publish_agreed,
    raise_failure,
    recover,
    staging_folder,
)
from hasten.checkpointing.rng import capture_rng_state, derive_rng_state, restore_rng_state
from hasten.checkpointing.sinks import SealedSink, Sink
from hasten.checkpointing.transaction import Transaction
from hasten.config.env import worker_group_restart
from hasten.exceptions import CheckpointError
from hasten.ops.collectives import barrier, broadcast_object_list, gather_object

_WHAT = "The save"  # the failure's subject (raise_failure) on the calling thread


class MapLocationError(CheckpointError, TypeError):
    """``load_state(map_location=...)`` got a value other than None, 'cpu' or 'on_device' (a ``TypeError`` as
    in Accelerate, whose tests catch that type)."""


class CheckedModels(Protocol):
    """What the strategy's ``check`` returns: the optimizer states the manager applies itself."""

    optimizer_states: list[Any]


class ModelCheckpointing(Protocol):
    """How models and optimizers are saved and loaded: the strategy's checkpoint interface
    (``hasten.strategies.base.Strategy``; the strategy layer is above this one, so it is typed here)."""

    def weights_for_save(self, models: list[nn.Module]) -> list[dict[str, torch.Tensor]]: ...

    def save(self, models: list[nn.Module], optimizers: list[torch.optim.Optimizer], folder: Path, *,
             weights: list[dict[str, torch.Tensor]], writer: bool, safe_serialization: bool = True,
             sink: Sink, engine_kwargs: Mapping[str, Any] | None = None) -> None: ...

    def engine_checkpoint_kwargs(self, call: str, kwargs: Mapping[str, Any]) -> dict[str, Any]: ...

    def check(self, models: list[nn.Module], optimizers: list[torch.optim.Optimizer], folder: Path, *,
              strict: bool = True, map_location: Any = "cpu") -> CheckedModels: ...

    def load(self, models: list[nn.Module], optimizers: list[torch.optim.Optimizer], folder: Path,
             checked: Any, *, strict: bool = True, engine_kwargs: Mapping[str, Any] | None = None) -> None: ...

    def accumulated_gradients(self, model: nn.Module) -> dict[str, torch.Tensor]: ...

    def restore_accumulated_gradients(self, model: nn.Module, grads: dict[str, torch.Tensor], path: Path) -> None: ...


@dataclass(frozen=True)
class Ranks:
    """Where this process sits in the run (what the protocol needs to know of the process group)."""

    num_processes: int = 1
    process_index: int = 0
    local_process_index: int = 0
    num_local_processes: int = 1

    @property
    def is_main(self) -> bool:
        """The process with global rank 0 (it checks, publishes and prunes)."""
        return self.process_index == 0

    @property
    def is_local_main(self) -> bool:
        """The first process of its machine (it publishes on file systems the main process does not see)."""
        return self.local_process_index == 0

    @classmethod
    def of_process_group(cls) -> Ranks:
        """This process in torch's default process group (one process when there is none).

        The position on the machine is the launcher's (as ``PartialState`` reads it) when it describes
        this group, else the global one (a single machine).
        """
        import torch.distributed as dist

        from hasten.environments import current_process_info

        if not (dist.is_available() and dist.is_initialized()):
            return cls()
        world, rank = dist.get_world_size(), dist.get_rank()
        info = current_process_info()[1]
        if info.world_size == world and info.rank == rank:
            return cls(world, rank, info.local_rank, info.local_world_size)
        return cls(world, rank, rank, world)


@dataclass
class TrainingObjects:
    """The stateful objects of one run, handed to :meth:`CheckpointManager.save` / :meth:`~CheckpointManager.load`.

    Every object has ``state_dict``/``load_state_dict``. Lists are saved in order (Accelerate's ``_i``
    suffixes) and must be given in the same order to load.

    Attributes:
        models: the prepared models (written and read by the strategy).
        optimizers: the prepared optimizers; the strategy receives the inner ones (``.optimizer``).
        schedulers: learning-rate schedulers.
        dataloaders: data loaders; those with ``state_dict`` save their position.
        custom_objects: objects registered for checkpointing.
        scaler: the loss scaler (``state_dict``/``load_state_dict``), or None when gradients are not scaled.
        step: the accumulation step counter, saved with this process's random generator states.
        accumulating: inside a gradient-accumulation window: the gradients gathered so far are saved too.
        save_hooks: ``hook(models, weights, folder)`` run before models are written (may edit ``weights``).
        load_hooks: ``hook(models, folder)`` run before a checkpoint is read.
    """

    models: list[nn.Module] = field(default_factory=list)
    optimizers: list[Any] = field(default_factory=list)
    schedulers: list[Any] = field(default_factory=list)
    dataloaders: list[Any] = field(default_factory=list)
    custom_objects: list[Any] = field(default_factory=list)
    scaler: Any = None
    step: int = 0
    accumulating: bool = False
    save_hooks: list[Callable[..., Any]] = field(default_factory=list)
    load_hooks: list[Callable[..., Any]] = field(default_factory=list)

    def raw_optimizers(self) -> list[Any]:
        """The engines' optimizers behind the prepared wrappers (what the strategy saves and checks)."""
        return [getattr(opt, "optimizer", opt) for opt in self.optimizers]


@dataclass
class _LoadPlan:
    """Everything a load read and checked, before anything is applied."""

    checked: CheckedModels
    schedulers: list[Any]
    loaders: list[Any]
    custom: list[Any]
    scaler: Any  # None: nothing to restore
    warning: str | None
    rng_path: Path
    rng: dict[str, Any]
    gradients: list[tuple[Path, dict[str, torch.Tensor]] | None]
    saved_processes: int | None = None


class CheckpointManager:
    """Save, check, load and rotate checkpoint folders of one run (see the module docstring).

    Args:
        models: the strategy, which saves, checks and loads model and optimizer state.
        ranks: this process's position (default: torch's default process group).
        device: where ``load(map_location="on_device")`` places optimizer state.

    Example:
        >>> manager = CheckpointManager(strategy)
        >>> manager.save(TrainingObjects(models=[model], optimizers=[optimizer]), "ckpt")
        >>> manager.load(TrainingObjects(models=[model], optimizers=[optimizer]), "ckpt")
    """

    def __init__(self, models: ModelCheckpointing, ranks: Ranks | None = None,
                 device: torch.device | str = "cpu") -> None:
        self.models = models
        self.ranks = ranks if ranks is not None else Ranks.of_process_group()
        self.device = device
        self.background: background.BackgroundSaver | None = None  # created by the first asynchronous save

    # ------------------------------------------------------------------------------------- saving
    def save(self, objects: TrainingObjects, output_dir: str | os.PathLike[str] | None = None, *,
             config: ProjectConfiguration | None = None, writer: bool | None = None,
             safe_serialization: bool = True, async_save: bool = False,
             engine_kwargs: Mapping[str, Any] | None = None) -> Path:
        """Write ``objects`` into a new checkpoint folder and publish it; returns the folder. Every process calls it.

        Args:
            objects: what to save.
            output_dir: the folder (ignored with ``config.automatic_checkpoint_naming``).
            config: automatic naming, ``total_limit`` and the iteration counter (advanced by one).
            writer: whether this process writes the files all processes share (default: the main process).
            safe_serialization: model weights as safetensors (else ``pytorch_model.bin``).
            async_save: return once the state is captured in host memory; :meth:`wait` for publication.
            engine_kwargs: for an engine that writes its own checkpoint (``save_state``'s extra
                keyword arguments, checked by the strategy's ``engine_checkpoint_kwargs``).

        Raises:
            ConfigurationError: ``engine_kwargs`` the strategy does not take (before anything is written).
            CheckpointError: the folder cannot be used, the previous asynchronous save failed, a
                strategy cannot save inside an accumulation window (before anything is written), or
                a step of the save failed on some process (the same message on every process).
        """
        self.wait()  # at most one save in flight; raises the failure of the previous one
        options = self.models.engine_checkpoint_kwargs("save_state", engine_kwargs or {})
        config = config if config is not None else ProjectConfiguration()
        writer = self.ranks.is_main if writer is None else writer
        target = self._target(output_dir, config)
        # Inside an accumulation window the gradients gathered so far are part of the state. They are
        # captured first: a strategy that cannot keep them refuses here, before anything is written.
        gradients = [self.models.accumulated_gradients(m) for m in objects.models] if objects.accumulating else []
        self._start(target, config)
        pub = Publication(target, staging_folder(target), self.ranks.num_processes, self.ranks.is_main,
                          self.ranks.is_local_main, config.total_limit, bool(config.automatic_checkpoint_naming))
        agree = agree_on_default_group(self.ranks.num_processes)
        # The pre-hooks may fail on one process only; the strategy's writes that follow may be
        # collective (DCP, DeepSpeed), so every process learns of it before any of them starts one.
        weights, error = attempt(lambda: self._weights_for_save(objects, pub.staging))
        agreed = agree(error)
        if agreed is not None:
            raise_failure(_WHAT, pub, agreed)
        if async_save:
            return self._save_in_background(objects, pub, weights, gradients, config, writer, safe_serialization,
                                            options)
        sink = SealedSink(pub.staging)  # each file checksummed as written, fsync'ed in the background

        def write_and_seal() -> dict[str, tuple[int, str]]:
            self._write(objects, pub.staging, weights, gradients, writer, safe_serialization, sink, options)
            return sink.finish()  # this process's files are durable before the others are told so

        try:
            publish_agreed(pub, write_and_seal, agree, _WHAT)
        finally:
            sink.close()
        config.iteration += 1
        return target

    def wait(self) -> None:
        """Wait until the asynchronous save in flight (if any) is published.

        Raises:
            CheckpointError: the background save failed; the same message on every process, naming
                the process and the file. The previous checkpoint is then intact.
        """
        if self.background is not None:
            self.background.wait()

    def _target(self, output_dir: str | os.PathLike[str] | None, config: ProjectConfiguration) -> Path:
        if config.automatic_checkpoint_naming:
            # Numbering continues after the highest checkpoint present (the main process's view counts).
            iteration = next_iteration(config.project_dir, config.iteration) if self.ranks.is_main else 0
            if self.ranks.num_processes > 1:
                iteration = broadcast_object_list([iteration])[0]
            config.iteration = iteration
            return checkpoints_root(config.project_dir) / f"checkpoint_{config.iteration}"
        if output_dir is None:
            raise CheckpointError("save_state() needs `output_dir`, or "
                                  "`ProjectConfiguration(automatic_checkpoint_naming=True)` and a project_dir.")
        target = Path(os.path.abspath(Path(output_dir).expanduser()))  # "." and ".." have no name to stage beside
        # A symlinked folder (ckpt -> /scratch/...) stays a link: the save is staged and published beside its target.
        return Path(os.path.realpath(target)) if target.is_symlink() else target

    def _start(self, target: Path, config: ProjectConfiguration) -> None:
        """Main process: check, prune, create the staging folder; then everyone learns the outcome."""
        error = None
        if self.ranks.is_main:
            try:
                if config.automatic_checkpoint_naming and target.exists():
                    raise CheckpointError(
                        f"Checkpoint directory {target} already exists. Load it first (load_state restores the "
                        "iteration) or set `accelerator.project_configuration.iteration` to a new number.")
                check_target(target)
                prepare_staging(target)
            except (OSError, CheckpointError) as exc:
                error = str(exc)
        outcome = broadcast_object_list([error])[0]
        if outcome is not None:
            raise CheckpointError(outcome)
        staging_folder(target).mkdir(parents=True, exist_ok=True)  # other machines' local folders
        if self.ranks.is_main:
            run_stage_hooks("staged", staging_folder(target))

    def _weights_for_save(self, objects: TrainingObjects, staging: Path) -> list[dict[str, torch.Tensor]]:
        """The weights the strategy writes, after the save pre-hooks saw (and maybe edited) them."""
        weights = self.models.weights_for_save(objects.models)
        for hook in objects.save_hooks:
            hook(objects.models, weights, str(staging))
        return weights

    def _write(self, objects: TrainingObjects, staging: Path, weights: list[dict[str, torch.Tensor]],
               gradients: list[dict[str, torch.Tensor]], writer: bool, safe_serialization: bool,
               sink: Sink, engine_kwargs: dict[str, Any]) -> None:
        """This process's files, through ``sink`` (sealed, or staged for an asynchronous save)."""
        self.models.save(objects.models, objects.raw_optimizers(), staging, weights=weights, writer=writer,
                         safe_serialization=safe_serialization, sink=sink, engine_kwargs=engine_kwargs)
        if writer:
            self._write_shared_files(objects, staging, sink)
        rng_file = staging / ckpt.RNG.format(rank=self.ranks.process_index)
        ckpt.torch_save(capture_rng_state(objects.step), rng_file, sink=sink)
        # Each process's own (they differ under no_sync), or the next optimizer step after resuming would differ.
        for i, grads in enumerate(gradients):
            if grads:
                path = staging / ckpt.GRADIENTS.format(suffix=ckpt.suffix(i), rank=self.ranks.process_index)
                ckpt.save_gradient_tensors(grads, path, sink=sink)

    @staticmethod
    def _write_shared_files(objects: TrainingObjects, folder: Path, sink: Sink) -> None:
        """What is not model or optimizer state (the strategy writes those): schedulers, loaders, scaler, objects."""
        for i, scheduler in enumerate(objects.schedulers):
            ckpt.torch_save(scheduler.state_dict(), folder / ckpt.SCHEDULER.format(suffix=ckpt.suffix(i)), sink=sink)
        for i, loader in enumerate(objects.dataloaders):
            if hasattr(loader, "state_dict"):
                ckpt.torch_save(loader.state_dict(), folder / ckpt.DATALOADER.format(suffix=ckpt.suffix(i)),
                                sink=sink)
        scaler_state = objects.scaler.state_dict() if objects.scaler is not None else None
        if scaler_state is not None:
            ckpt.torch_save(scaler_state, folder / ckpt.SCALER, sink=sink)
        for i, obj in enumerate(objects.custom_objects):
            ckpt.torch_save(obj.state_dict(), folder / ckpt.CUSTOM.format(index=i), sink=sink)

    def _save_in_background(self, objects: TrainingObjects, pub: Publication, weights: list[dict[str, torch.Tensor]],
                            gradients: list[dict[str, torch.Tensor]], config: ProjectConfiguration, writer: bool,
                            safe_serialization: bool, engine_kwargs: dict[str, Any]) -> Path:
        if self.background is None:  # collective: every process creates the side group together
            self.background = background.BackgroundSaver(
                background.Coordinator.create(self.ranks.num_processes, self.ranks.process_index))
        buffers = self.background.buffers

        def capture() -> background.SnapshotSink:
            with background.SnapshotSink(pub.staging, buffers).capturing() as snapshot:
                self._write(objects, pub.staging, weights, gradients, writer, safe_serialization, snapshot,
                            engine_kwargs)
            return snapshot

        snapshot, error = attempt(capture)
        agreed = agree_on_default_group(self.ranks.num_processes)(error)
        if agreed is not None:  # before the background thread starts: no process publishes
            raise_failure(_WHAT, pub, agreed)
        self.background.submit(snapshot, pub)
        config.iteration += 1
        return pub.target

    # ------------------------------------------------------------------------------------ loading
    def load(self, objects: TrainingObjects, input_dir: str | os.PathLike[str] | None = None, *,
             config: ProjectConfiguration | None = None, strict: bool = True, map_location: Any = None,
             verify_checksums: bool = True, engine_kwargs: Mapping[str, Any] | None = None) -> tuple[Path, int]:
        """Check a checkpoint, then restore it into ``objects``; returns the folder and the saved step counter.

        Every process calls it. ``input_dir=None`` with automatic naming loads the newest complete
        checkpoint, and the iteration counter of ``config`` continues after it.

        ``engine_kwargs`` go to an engine that loads its own checkpoint (``load_state``'s extra keyword
        arguments, checked by the strategy's ``engine_checkpoint_kwargs``).

        Raises:
            ConfigurationError: ``engine_kwargs`` the strategy does not take (before anything is read).
            CheckpointError: a missing folder or file, a damaged file, or a folder that does not match
                ``objects``; the same message on every process, and nothing changed.
        """
        self.wait()
        options = self.models.engine_checkpoint_kwargs("load_state", engine_kwargs or {})
        config = config if config is not None else ProjectConfiguration()
        folder = self._resolve(input_dir, config)
        for hook in objects.load_hooks:
            hook(objects.models, str(folder))
        location = self._map_location(map_location)
        plan = self._agree(lambda: self._read(objects, folder, strict, location, verify_checksums))
        if plan.warning and self.ranks.is_main:
            warnings.warn(plan.warning, UserWarning, stacklevel=3)  # the caller of Accelerator.load_state
        step = self._apply(objects, plan, strict, folder, options)
        iteration = iteration_of(folder)
        if config.automatic_checkpoint_naming and iteration is not None:
            config.iteration = iteration + 1
        barrier()
        restart = worker_group_restart()
        if restart and self.ranks.is_main:
            # The launcher logs who left or joined and the new world size; only the workers know which
            # checkpoint the restarted group resumed, so they complete the membership change's log.
            print(f"hasten: the restarted worker group (restart {restart}) resumed from {folder.name} ({folder}), "
                  f"saved by {plan.saved_processes} processes, now {self.ranks.num_processes}", file=sys.stderr,
                  flush=True)
        return folder, step

    def _resolve(self, input_dir: str | os.PathLike[str] | None, config: ProjectConfiguration) -> Path:
        if input_dir is None:
            if not config.automatic_checkpoint_naming:
                raise CheckpointError("load_state() needs `input_dir`, or automatic checkpoint naming to find "
                                      "the newest checkpoint.")
            newest = newest_checkpoint(config.project_dir)
            if newest is None:
                raise CheckpointError(f"No complete checkpoint under {checkpoints_root(config.project_dir)}.")
            return newest
        folder = Path(os.path.abspath(Path(input_dir).expanduser()))
        recover(folder)  # a save that died between the renames of the fallback publication
        if not folder.is_dir():
            raise CheckpointError(f"Checkpoint folder {folder} does not exist (or is not a folder).")
        if is_incomplete(folder):
            raise CheckpointError(f"{folder} holds an unfinished save (it was interrupted); load another checkpoint.")
        return folder

    def _map_location(self, value: Any) -> Any:
        if value in (None, "cpu"):
            return "cpu"
        if value == "on_device":
            return self.device
        raise MapLocationError(f"Unsupported optimizer map location passed, please choose one of `None`, `'cpu'`, "
                               f"or `'on_device'`: load_state(map_location={value!r}).")

    def _agree(self, read: Callable[[], _LoadPlan]) -> _LoadPlan:
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
        messages = gather_object([message]) if self.ranks.num_processes > 1 else [message]
        failed = [(rank, text) for rank, text in enumerate(messages) if text is not None]
        if failed:
            rank, text = failed[0]
            prefix = "" if self.ranks.num_processes == 1 else f"process {rank}: "
            raise CheckpointError(f"load_state: {prefix}{text}") from error

    def _read(self, objects: TrainingObjects, folder: Path, strict: bool, map_location: Any,
              verify: bool) -> _LoadPlan:
        ranks = self.ranks
        manifest = read_manifest(folder)
        if manifest is not None and verify:  # the machine's processes split the files between them
            share = my_share(sorted(manifest["files"]), ranks.local_process_index, max(ranks.num_local_processes, 1))
            verify_files(folder, manifest, share)
        checked = self.models.check(objects.models, objects.raw_optimizers(), folder, strict=strict,
                                    map_location=map_location)
        schedulers = []
        for i, scheduler in enumerate(objects.schedulers):
            path = folder / ckpt.SCHEDULER.format(suffix=ckpt.suffix(i))
            schedulers.append(ckpt.torch_load(path))
            checks.check_scheduler_state(scheduler, schedulers[-1], path)
        saved_loaders = ckpt.count_files(folder, "dataloader_state")
        if saved_loaders and saved_loaders != len(objects.dataloaders):
            raise CheckpointError(f"{folder} holds the state of {saved_loaders} data loaders but "
                                  f"{len(objects.dataloaders)} are prepared; prepare the same loaders, in the same "
                                  "order, before load_state.")
        loaders = [ckpt.torch_load(folder / ckpt.DATALOADER.format(suffix=ckpt.suffix(i))) for i in range(saved_loaders)]
        saved_custom = ckpt.count_files(folder, "custom_checkpoint_")
        if saved_custom != len(objects.custom_objects):
            raise CheckpointError(f"{folder} holds {saved_custom} registered objects but {len(objects.custom_objects)} "
                                  "are registered with register_for_checkpointing; register the same objects.")
        custom = [ckpt.load_registered_state(folder / ckpt.CUSTOM.format(index=i)) for i in range(saved_custom)]
        scaler = None
        if objects.scaler is not None and (folder / ckpt.SCALER).is_file():
            scaler = ckpt.torch_load(folder / ckpt.SCALER)
            checks.check_scaler_state(scaler, folder / ckpt.SCALER)
        checks.check_loader_states(folder, objects.dataloaders, loaders)  # every field in range, first
        warning = checks.check_process_count(folder, manifest, ranks.num_processes, loaders)
        rng_path, derive = checks.rng_source(folder, manifest, ranks.process_index, ranks.num_processes)
        if not rng_path.is_file():
            raise CheckpointError(checks.missing_rng_message(folder, rng_path, manifest, ranks.process_index,
                                                             ranks.num_processes))
        rng = ckpt.load_rng_file(rng_path)  # Accelerate's files hold NumPy states
        checks.check_rng_fields(rng, rng_path)
        if derive:  # a process the saving run did not have (documented rule in derive_rng_state)
            rng = derive_rng_state(rng, ranks.process_index)
        checks.check_rng_state(rng, rng_path)
        gradients: list[tuple[Path, dict[str, torch.Tensor]] | None] = []
        for i, _ in enumerate(objects.models):
            path = folder / ckpt.GRADIENTS.format(suffix=ckpt.suffix(i), rank=ranks.process_index)
            gradients.append((path, ckpt.read_gradients(path)) if path.is_file() else None)
        return _LoadPlan(checked, schedulers, loaders, custom, scaler, warning, rng_path, rng, gradients,
                         checks.saved_process_count(folder, manifest))

    def _apply(self, objects: TrainingObjects, plan: _LoadPlan, strict: bool, folder: Path,
               engine_kwargs: dict[str, Any]) -> int:
        # Everything was read and checked; apply the small states first, each with an undo, so a
        # failure (a registered object refusing its state) puts back what was already restored. The
        # processes agree after the small states (before the models, whose loading may be collective)
        # and again at the end: a failure on any process is undone and raised on every process.
        tx = Transaction(folder)
        self._agreed_step(tx, lambda: self._apply_small_states(tx, objects, plan))
        restored: list[int] = []
        self._agreed_step(tx, lambda: restored.append(self._apply_models_and_generators(tx, objects, plan, strict,
                                                                                         folder, engine_kwargs)))
        return restored[0]

    def _agreed_step(self, tx: Transaction, action: Callable[[], Any]) -> None:
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

    @staticmethod
    def _apply_small_states(tx: Transaction, objects: TrainingObjects, plan: _LoadPlan) -> None:
        if plan.scaler is not None:
            tx.apply("the loss scaler", objects.scaler, plan.scaler)
        for i, (optimizer, state) in enumerate(zip(objects.optimizers, plan.checked.optimizer_states)):
            tx.apply(f"optimizer #{i}", optimizer, state)
        for i, (scheduler, state) in enumerate(zip(objects.schedulers, plan.schedulers)):
            tx.apply(f"scheduler #{i}", scheduler, state)
        for i, (loader, state) in enumerate(zip(objects.dataloaders, plan.loaders)):
            tx.apply(f"data loader #{i}", loader, state)
        for i, (obj, state) in enumerate(zip(objects.custom_objects, plan.custom)):
            tx.apply(f"registered object #{i} ({type(obj).__name__})", obj, state)

    def _apply_models_and_generators(self, tx: Transaction, objects: TrainingObjects, plan: _LoadPlan, strict: bool,
                                     folder: Path, engine_kwargs: dict[str, Any]) -> int:
        """Last, once every small state is in: the strategy's part, accumulated gradients, then the generators."""
        def load_models() -> None:
            self.models.load(objects.models, objects.raw_optimizers(), folder, plan.checked, strict=strict,
                             engine_kwargs=engine_kwargs)
            for model, saved in zip(objects.models, plan.gradients):
                if saved is not None:
                    self.models.restore_accumulated_gradients(model, saved[1], saved[0])

        tx.run("the models", load_models)
        generators = capture_rng_state(objects.step)
        tx.on_undo(lambda: restore_rng_state(generators, plan.rng_path))
        return restore_rng_state(plan.rng, plan.rng_path)


__all__ = ["CheckedModels", "CheckpointManager", "ModelCheckpointing", "Ranks", "TrainingObjects"]
