"""An asynchronous save is never lost at exit: every way out of a process waits for it first.

``save_state(..., async_save=True)`` is the usual last statement of a training script, so the save is
often still being written when the script ends. Each way out finishes and publishes it (the main
process prints one line while it waits), and a save that fails there has its error printed on every
process and makes the process exit non-zero (1) instead of passing silently:

* ``python script.py`` (and plain ``torchrun``): normal end, ``sys.exit`` or an uncaught exception.
  The wait runs before the interpreter joins its threads (:func:`~hasten._private_api.run_before_threads_join`),
  that is before ``concurrent.futures`` refuses new work (the background thread's fsync pool needs it)
  and before the ``atexit`` teardown of the process group (the save's agreement needs the group).
  On a failure it then runs the ``atexit`` functions and leaves with ``os._exit(1)``, as workers of
  ``hasten launch`` always leave (non-daemon threads of the script are not joined then).
* ``hasten launch`` workers: their bootstrap (:mod:`hasten.launchers.worker`) skips the interpreter's
  exit; it calls :func:`finish_saves` before the ``atexit`` functions and turns a failure into exit
  status 1 (the launcher then fails too).
* ``end_training`` waits with the same notice and raises the failure (:func:`wait_with_notice`).
* Whoever else ends the process group first (``destroy_process_group``, the notebook and test
  launchers' teardown): the group's release hooks finish the save before the group is destroyed; a
  failure there is printed and the process still exits non-zero at its exit.

``kill -9`` at any point of the wait is covered by the save's own crash safety: the previous
checkpoint stays loadable until the new one is complete (:mod:`hasten.checkpointing.background`).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import weakref
from pathlib import Path
from typing import Protocol

from hasten.exceptions import CheckpointError


class _Publication(Protocol):
    target: Path
    is_main: bool


class BackgroundSaver(Protocol):
    """What is waited for at exit (:class:`hasten.checkpointing.background.BackgroundSaver`, which imports this)."""

    @property
    def publication(self) -> _Publication | None: ...

    @property
    def in_flight(self) -> bool: ...

    def wait(self) -> None: ...

#: This process's savers that ever started a save (weak: an Accelerator that is gone takes its saver along),
#: each with the pid that started it (a forked child inherits the parent's, whose threads it does not have).
_SAVERS: weakref.WeakKeyDictionary[BackgroundSaver, int] = weakref.WeakKeyDictionary()
#: Failures met at a way out (already printed): the process must exit non-zero.
_FAILURES: list[str] = []
#: The pid whose interpreter exit runs :func:`_at_interpreter_exit` (one registration per process).
_REGISTERED: dict[str, int | None] = {"pid": None}


def track(saver: BackgroundSaver) -> None:
    """Finish ``saver``'s saves at every way out of this process (call it when a save starts)."""
    from hasten.runtime.process_group import add_before_end_hook

    pid = os.getpid()
    _SAVERS[saver] = pid
    add_before_end_hook(_before_group_ends)  # re-added each time: the group's teardown forgets its hooks
    if _REGISTERED["pid"] != pid:
        import concurrent.futures.thread  # noqa: F401 - its exit hook is registered first, so ours runs before it

        from hasten._private_api import run_before_threads_join

        if run_before_threads_join(_at_interpreter_exit):
            _REGISTERED["pid"] = pid


def wait_with_notice(saver: BackgroundSaver, before: str) -> None:
    """Wait for ``saver``'s save in flight; the main process says so on stderr while it waits.

    Raises:
        CheckpointError: the save failed (the same message on every process).
    """
    publication = saver.publication
    if saver.in_flight and publication is not None and publication.is_main:
        print(f"hasten: waiting for the asynchronous save of {publication.target} to be published before {before}",
              file=sys.stderr, flush=True)
    saver.wait()


def finish_saves(before: str = "exiting") -> str | None:
    """At a way out: wait for this process's saves in flight; print a failure on stderr and remember it.

    Returns:
        The failure (None when every save was published, or none was started). A failure that an
        earlier way out met is returned again: the process must still exit non-zero.
    """
    pid = os.getpid()
    for saver, owner in list(_SAVERS.items()):
        if owner != pid:
            continue
        try:
            wait_with_notice(saver, before)
        except CheckpointError as exc:
            print(f"hasten: {exc}", file=sys.stderr, flush=True)
            _FAILURES.append(str(exc))
    return _FAILURES[0] if _FAILURES else None


def _before_group_ends() -> None:
    finish_saves("the process group ends")  # a failure is printed here and ends the process non-zero later


def _at_interpreter_exit() -> None:
    """Interpreter exit (before threads are joined): finish the saves; on a failure leave with status 1."""
    if finish_saves() is None:
        return
    if multiprocessing.parent_process() is None:  # a forked child never runs its parent's atexit functions
        from hasten._private_api import run_exit_functions

        run_exit_functions()  # the process group's teardown, trackers, logging: what exit would run
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


__all__ = ["finish_saves", "track", "wait_with_notice"]
