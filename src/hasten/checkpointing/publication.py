"""The one publication sequence of a save, and its one agreement rule.

Synchronous and asynchronous saves end the same way (:func:`publish_agreed`): this process's files
are written and made durable, then the main process publishes the folder, then each machine's first
process publishes its own copy (file systems the main process does not see), then the main process
prunes to ``total_limit``. After each step **every process agrees** on the outcome: a failure on any
process (writing, sealing, publishing, pruning) stops the sequence on every process and is raised on
every process with the same message, naming the process that failed first. Until the main process
publishes, the previous checkpoint is untouched; publishing itself swaps folders atomically
(:func:`hasten.checkpointing.naming.publish`), so a failure leaves a complete checkpoint under the name.

The two saves differ only in how they agree and on which thread: a synchronous save agrees on the
calling thread over the default process group (:func:`agree_on_default_group`); the background thread
of an asynchronous save agrees on a gloo group of its own
(:meth:`hasten.checkpointing.background.Coordinator.first_error`), so it never interleaves with the
training loop's collectives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hasten.checkpointing.naming import prune, publish, run_stage_hooks
from hasten.exceptions import CheckpointError

#: ``agree(error)``: every process passes its error (None: it succeeded) and gets the first failure,
#: ``"process <rank>: <error>"`` (the bare error with one process), or None; the same on every process.
Agree = Callable[[str | None], str | None]

#: What a failure left behind, by the step that failed (the phrase the raised error carries).
_NOTHING_PUBLISHED = "nothing was published; the previous checkpoint is intact"
_PUBLISHING = "publishing did not finish; the folder holds a complete checkpoint, the previous one or the new one"
_PUBLISHED = "it was published"


@dataclass
class Publication:
    """What publishing a save needs (plain values: a background thread never touches the Accelerator)."""

    target: Path
    staging: Path
    num_processes: int
    is_main: bool
    is_local_main: bool
    prune_limit: int | None  # automatic naming: prune beyond this many (None: no pruning)
    automatic: bool


def attempt(step: Callable[[], Any]) -> tuple[Any, str | None]:
    """``step()``'s result and None, or None and its failure as the text the processes agree on."""
    try:
        return step(), None
    except Exception as exc:  # noqa: BLE001 - agreed with the other processes, then raised on every one
        return None, failure_text(exc)


def failure_text(exc: BaseException) -> str:
    """The text of a failure shared with the other processes (a CheckpointError's own message)."""
    return str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"


def first_failure(errors: list[str | None]) -> str | None:
    """The first process's failure among every process's ``errors`` (in rank order), naming it."""
    if len(errors) == 1:
        return errors[0]
    for rank, message in enumerate(errors):
        if message is not None:
            return f"process {rank}: {message}"
    return None


def agree_on_default_group(num_processes: int) -> Agree:
    """:data:`Agree` over torch's default process group (the calling thread's collectives)."""
    def agree(error: str | None) -> str | None:
        if num_processes == 1:
            return error
        from hasten.ops.collectives import gather_object

        return first_failure(list(gather_object([error])))

    return agree


def raise_failure(what: str, pub: Publication, agreed: str, state: str = _NOTHING_PUBLISHED) -> None:
    """Raise the agreed failure of the save of ``pub`` (the same message on every process).

    Raises:
        CheckpointError: always, ``"<what> of <target> failed (<what it left>): <agreed>"``.
    """
    raise CheckpointError(f"{what} of {pub.target} failed ({state}): {agreed}")


def publish_agreed(pub: Publication, write: Callable[[], dict[str, tuple[int, str]] | None], agree: Agree,
                   what: str) -> None:
    """Write this process's files, then publish and prune, every process agreeing after each step.

    Every process calls it, whatever its role: each takes part in every agreement.

    Args:
        pub: the save to publish.
        write: writes and seals this process's files; returns ``{relative path: (size, crc32)}`` of
            the files it sealed (see :func:`hasten.checkpointing.manifest.write_manifest`).
        agree: how the processes agree (see :data:`Agree`).
        what: the save's name in the error (``"The save"``, ``"The background save"``).

    Raises:
        CheckpointError: a step failed on some process: the same message on every process, naming
            that process, the cause and what the failure left behind.
    """
    sealed, error = attempt(write)
    if error is None:
        _, error = attempt(lambda: run_stage_hooks("before_publish", pub.staging))
    agreed = agree(error)
    if agreed is not None:
        raise_failure(what, pub, agreed)
    steps: list[tuple[bool, Callable[[], Any], str]] = [
        (pub.is_main, lambda: publish(pub.target, pub.num_processes, sealed), _PUBLISHING),
        # machines that do not share the main process's file system publish their own copy
        (pub.is_local_main and not pub.is_main, lambda: publish(pub.target, pub.num_processes, sealed), _PUBLISHED),
        (pub.is_main and pub.automatic, lambda: _rotate(pub), _PUBLISHED),
    ]
    for mine, step, left in steps:
        agreed = agree(attempt(step)[1] if mine else None)
        if agreed is not None:
            raise_failure(what, pub, agreed, left)


def _rotate(pub: Publication) -> None:
    run_stage_hooks("published", pub.target)
    prune(pub.target.parent, pub.prune_limit, keep=pub.target)  # only now: never zero checkpoints


__all__ = ["Agree", "Publication", "agree_on_default_group", "attempt", "failure_text", "first_failure",
           "publish_agreed", "raise_failure"]
