"""The entry point ``hasten launch`` gives each worker: run the user's script, then leave cleanly.

``python -m hasten.launchers.worker [--module] TARGET ARGS...`` runs ``TARGET`` exactly as
``python TARGET ARGS`` (or ``python -m TARGET``) would, then finishes an asynchronous save still in
flight (a failed one makes the exit status 1), runs the interpreter's exit handlers (trackers
finishing, hasten's process-group teardown, logging) and ends the process with the script's
exit code *without* interpreter finalization. Finalization is where gloo aborts a finished run
("terminate called without an active exception") when objects that hold the process group (DDP
reducers, FSDP2 meshes, DeepSpeed engines) are destroyed after it; skipping it makes a successful
script a successful worker, always.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from typing import Any

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None = None) -> None:
    """Linux: have the kernel SIGKILL this process when its parent (the launcher) dies, even by SIGKILL.

    ``parent_pid`` is the launcher's pid as seen before the call: if the launcher already died (the
    process was re-parented in the meantime), exit at once instead of running orphaned. A no-op on
    other systems.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(128 + int(signal.SIGKILL))


def _exit_code(code: Any) -> int:
    """What ``SystemExit(code)`` means as a process exit status (as the interpreter does it)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def run_target(target: str, args: list[str], as_module: bool) -> int:
    """Run the script (or module) as ``__main__``; return its exit status."""
    sys.argv = [target, *args]
    if not as_module:
        sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python script.py` sets it
    try:
        if as_module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        return _exit_code(exc.code)
    except BaseException:  # noqa: BLE001 - report exactly like an uncaught exception, then fail
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


def _async_save_failed() -> bool:
    """Finish an asynchronous save the script left in flight (before the ``atexit`` teardown of its group).

    The interpreter's own exit, which does that in ``python script.py``, is skipped here. True when the
    save failed (its error is printed by every process).
    """
    at_exit = sys.modules.get("hasten.checkpointing.at_exit")  # not imported: the script never saved
    return at_exit is not None and at_exit.finish_saves() is not None


def main(argv: list[str] | None = None) -> None:
    """Run the worker described by ``argv`` and exit with its status."""
    die_with_parent(os.getppid())
    argv = list(sys.argv[1:] if argv is None else argv)
    as_module = argv[:1] == ["--module"]
    if as_module:
        argv = argv[1:]
    if not argv:
        print("usage: python -m hasten.launchers.worker [--module] TARGET [ARGS...]", file=sys.stderr)
        os._exit(2)
    from hasten._accelerate_alias import install_unless_real_accelerate
    from hasten._private_api import run_exit_functions
    from hasten.config.env import launch_config
    from hasten.launchers.affinity import pin_local_rank
    from hasten.launchers.machines.store import bind_worker_store

    config = launch_config(os.environ)
    if config is not None:
        pin_local_rank(config, os.environ)  # --enable_cpu_affinity: before the script starts any thread

    from hasten.launchers.mpirun import mpi_worker_store

    store = bind_worker_store(os.environ) or mpi_worker_store(os.environ)  # noqa: F841 - kept alive while the script runs
    install_unless_real_accelerate()  # a Trainer/TRL/PEFT script runs unchanged without Accelerate installed
    code = run_target(argv[0], argv[1:], as_module)
    if _async_save_failed() and code == 0:
        code = 1
    run_exit_functions()  # trackers, hasten's teardown, logging.shutdown: everything exit would run
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
