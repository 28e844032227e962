"""Ray Train: hand hasten's checkpoints to Ray, resume from the one Ray gives back, save when Ray warns of preemption.

Inside ``ray.train.torch.TorchTrainer``'s training function an ordinary hasten script needs nothing from this
module: Ray starts the process group and exports torchrun's variables (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ...) before the function runs, and ``Accelerator()`` adopts that group and those ranks as it
adopts any running group. The configuration file named by ``ACCELERATE_CONFIG_FILE`` (or the default one)
applies as in any worker not started by ``hasten launch``. This module adds what only Ray has:

- :func:`report`: save hasten's crash-safe checkpoint (``save_state``) and report it, with metrics, through
  ``ray.train.report``, so Ray keeps it and gives it back after a failure or an elastic resize;
- :func:`load_checkpoint`: resume from ``ray.train.get_checkpoint()`` with ``accelerator.load_state``
  (exact, data position included, also on another number of workers);
- :func:`save_if_preempted`: Ray's preemption notice (a node being drained) turned into one save at the same
  step on every worker, reported to Ray, so the restart after the node is gone resumes from that step.

``ray`` is imported when one of these functions runs, never at import time.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hasten.exceptions import ConfigurationError, MissingDependencyError

#: The preemption notice :func:`save_if_preempted` last saved for (its preempted nodes): one save per notice.
_ANSWERED: dict[str, Any] = {"notice": None}


def _train_module() -> Any:
    try:
        import ray.train
    except ImportError as exc:
        raise MissingDependencyError("ray[train]", "hasten.integrations.ray") from exc
    return ray.train


def _checked_session(train: Any, what: str) -> None:
    """Refuse to run outside a Ray Train worker, where Ray's own call would fail with a less direct message."""
    try:
        train.get_context()
    except Exception as exc:  # noqa: BLE001 - Ray raises its own error type, which differs between versions
        raise ConfigurationError(
            f"hasten.integrations.ray.{what}() was called outside a Ray Train worker ({exc}). HINT: call it inside "
            "the training function given to ray.train.torch.TorchTrainer.") from None


def report(accelerator: Any, metrics: Mapping[str, Any], output_dir: str | os.PathLike[str] | None = None,
           **save_state_kwargs: Any) -> Path:
    """Save the training state with ``accelerator.save_state`` and report it to Ray Train with ``metrics``.

    Call it on every worker, at the same step (``ray.train.report`` waits for all of them). The checkpoint
    is hasten's own folder (written under a temporary name and published complete, so a crash never leaves
    a half-written one); Ray copies it to the run's storage and gives it back to :func:`load_checkpoint`.
    Only the first worker of each machine hands the folder to Ray: on one machine (or a shared file system)
    it holds every worker's files, and on machines with their own disks Ray merges each machine's files into
    one checkpoint. An asynchronous save (``async_save=True``) is waited for first, since Ray copies at once.

    Args:
        accelerator: the run's :class:`~hasten.Accelerator`.
        metrics: what Ray records with this checkpoint (Ray keeps rank 0's).
        output_dir: where to save; None for the automatic name of the project's checkpoints folder
            (``ProjectConfiguration(automatic_checkpoint_naming=True)``).
        **save_state_kwargs: passed to ``save_state`` (``safe_serialization``, ``async_save``).

    Returns:
        The checkpoint folder hasten wrote.

    Example:
        >>> for step, batch in enumerate(loader, 1):
        ...     ...
        ...     if step % 100 == 0:
        ...         report(accelerator, {"loss": loss.item(), "step": step})
    """
    train = _train_module()
    _checked_session(train, "report")
    folder = Path(accelerator.save_state(output_dir, **save_state_kwargs))
    accelerator.wait_for_checkpoint()
    hands_folder = accelerator.local_process_index == 0
    checkpoint = train.Checkpoint.from_directory(str(folder)) if hands_folder else None
    # One directory name for every worker's upload, so the machines' files land in one checkpoint.
    train.report(dict(metrics), checkpoint=checkpoint, checkpoint_dir_name=folder.name)
    return folder


def load_checkpoint(accelerator: Any, default: Any = None, **load_state_kwargs: Any) -> Path | None:
    """Resume from the checkpoint Ray Train gives this run (``ray.train.get_checkpoint()``), else from ``default``.

    Call it on every worker after ``accelerator.prepare(...)`` (and after ``register_for_checkpointing``).
    The state is restored by ``accelerator.load_state``: models, optimizers, schedulers, random states and
    the prepared data loaders' position, so the run continues with the next sample. On another number of
    workers than the run that saved (an elastic resize, or a run started again with a new ``ScalingConfig``)
    hasten maps the state onto the new number of processes; keep the global batch (per-worker batch x
    workers) the same and the steps see the samples the uninterrupted run's would have.

    Args:
        accelerator: the run's :class:`~hasten.Accelerator`, its objects prepared.
        default: what to load when Ray has no checkpoint for this run (its first attempt): a
            ``ray.train.Checkpoint`` or a folder, for example passed in ``train_loop_config``. Ray Train V2
            dropped ``TorchTrainer(resume_from_checkpoint=...)``; this is its replacement.
        **load_state_kwargs: passed to ``load_state``.

    Returns:
        The folder loaded, or None when there was nothing to load (a fresh start).

    Example:
        >>> model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        >>> load_checkpoint(accelerator, default=config.get("resume_from"))
    """
    train = _train_module()
    _checked_session(train, "load_checkpoint")
    checkpoint = train.get_checkpoint() or default
    if checkpoint is None:
        return None
    if not isinstance(checkpoint, train.Checkpoint):  # a folder (Ray's Checkpoint is os.PathLike but refuses fspath)
        checkpoint = train.Checkpoint.from_directory(os.fspath(checkpoint))
    with checkpoint.as_directory() as folder:  # the storage folder itself when local, else a download
        accelerator.load_state(folder, **load_state_kwargs)
        return Path(folder)


def save_if_preempted(accelerator: Any, metrics: Mapping[str, Any], output_dir: str | os.PathLike[str] | None = None,
                      **save_state_kwargs: Any) -> Path | None:
    """Save and report a checkpoint once when Ray Train announces that a node of this run will be preempted.

    Ray Train (2.60 has it) watches for nodes being drained (a spot instance reclaimed, ``ray drain-node``) and
    tells every worker through ``ray.train.get_preemption_info()``, which agrees on one answer across the
    workers: so every worker saves at the same step. Call this on every worker at the same point of each
    step (after ``optimizer.step()``); the first call that sees a notice saves through :func:`report`, later
    calls for the same notice do nothing, and training goes on until the node goes, after which Ray restarts
    the run and :func:`load_checkpoint` resumes from this step. Each call is a small exchange between the
    workers, so for very short steps call it every few steps.

    Returns:
        The checkpoint folder when this call saved one, else None.

    Raises:
        ConfigurationError: this Ray has no preemption notices (``ray.train.get_preemption_info``).

    Example:
        >>> optimizer.step()
        >>> if step % 10 == 0:
        ...     save_if_preempted(accelerator, {"step": step}, f"checkpoints/step_{step}")
    """
    train = _train_module()
    _checked_session(train, "save_if_preempted")
    notice_of = getattr(train, "get_preemption_info", None)
    if notice_of is None:
        raise ConfigurationError(
            "this Ray has no ray.train.get_preemption_info (Ray Train's preemption notices; Ray 2.60 has them). "
            "HINT: upgrade ray[train], or save with hasten.integrations.ray.report() at your own interval.")
    notice = notice_of()
    if notice is None:
        return None
    key = repr(sorted(getattr(notice, "preempted_node_ids", [])))
    if _ANSWERED["notice"] == key:
        return None
    _ANSWERED["notice"] = key
    return report(accelerator, metrics, output_dir, **save_state_kwargs)


__all__ = ["load_checkpoint", "report", "save_if_preempted"]
