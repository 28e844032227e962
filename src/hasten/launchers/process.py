"""Run one command as a child process with extra environment variables, forwarding termination signals
and propagating its exit code (the single-process, SLURM-task and mpirun paths)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from types import FrameType

from hasten.exceptions import LaunchError
from hasten.launchers.worker import die_with_parent

# SIGUSR1/2 too: SLURM's `--signal=USR1@90` (hasten launch --preemption_signal USR1) reaches the launcher,
# which must pass it on instead of dying of it; the worker stops at a step boundary and exits with 75.
_FORWARDED = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2")
                   if hasattr(signal, name))


def exit_code(returncode: int) -> int:
    """A shell-style exit code: a child killed by signal N gives 128 + N."""
    return returncode if returncode >= 0 else 128 - returncode


def _child_dies_with_launcher() -> None:
    """Runs in the forked child before exec: SIGKILL it when the launcher dies (Linux)."""
    die_with_parent()


def run_process(command: list[str], extra_env: Mapping[str, str]) -> int:
    """Run ``command`` with ``extra_env`` added to this process's environment; return its exit code.

    SIGTERM/SIGHUP/SIGUSR1/SIGUSR2 sent to the launcher are passed on to the child; Ctrl-C reaches the child through
    the terminal's process group, and the launcher then waits for it to finish.

    Example:
        >>> run_process([sys.executable, "-c", "pass"], {"HASTEN_LAUNCH_CONFIG": "{}"})
        0

    Raises:
        LaunchError: the command cannot be started (missing executable, not executable).
    """
    env = dict(os.environ)
    env.update(extra_env)
    try:
        child = subprocess.Popen(command, env=env, preexec_fn=_child_dies_with_launcher)
    except OSError as exc:
        raise LaunchError(f"Cannot start {command[0]!r}: {exc.strerror}. HINT: check the path; with --no_python "
                          "the script must be an executable file.") from None

    def forward(signum: int, frame: FrameType | None) -> None:
        child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in _FORWARDED}
    try:
        while True:
            try:
                return exit_code(child.wait())
            except KeyboardInterrupt:
                # The child got the same Ctrl-C; give it the chance to stop cleanly, then insist.
                try:
                    return exit_code(child.wait(timeout=10))
                except (subprocess.TimeoutExpired, KeyboardInterrupt):
                    child.kill()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sys.stdout.flush()
