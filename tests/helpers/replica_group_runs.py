"""Running ``hasten launch --replica_groups`` from tests: torchft's interpreter, and cleaning up every process.

torchft lives in its own venv (``make tft-venv``; ``make test`` passes its interpreter as HASTEN_TORCHFT_PYTHON).
Every process a launch starts carries a unique tag in its environment, so that whatever survives (torchrun's
workers run in sessions of their own) is found and killed afterwards.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TAG_VAR = "HASTEN_FT_TEST_RUN"


def torchft_python() -> str:
    """The interpreter with torchft: this one, else the venv ``make tft-venv`` builds."""
    import importlib.util

    if importlib.util.find_spec("torchft") is not None:
        return sys.executable
    candidate = Path(os.environ.get("HASTEN_TORCHFT_PYTHON") or ROOT / ".tft-venv" / "bin" / "python")
    if not candidate.exists():
        pytest.fail(f"torchft is not installed here and there is no torchft environment at {candidate}: run "
                    "`make tft-venv` (`make test` builds it)")
    return str(candidate)


def new_tag() -> str:
    """A value for :data:`TAG_VAR` that marks one test's processes."""
    return uuid.uuid4().hex


def launch_env(tag: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a tagged launch (this worktree's ``src`` first)."""
    return {**os.environ, "PYTHONPATH": str(ROOT / "src"), TAG_VAR: tag, **(extra or {})}


def launch_argv(*flags: str) -> list[str]:
    """``python -m hasten.commands.main launch --cpu FLAGS`` with torchft's interpreter."""
    return [torchft_python(), "-m", "hasten.commands.main", "launch", "--cpu", *flags]


def processes_with(tag: str) -> list[int]:
    """Processes whose environment holds ``TAG_VAR=tag`` (a launcher, its groups and their workers)."""
    needle = f"{TAG_VAR}={tag}".encode()
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if needle in f.read():
                        found.append(int(name))
            except OSError:
                continue
    return found


def kill_tagged(tag: str, procs: Sequence[subprocess.Popen[str]] = ()) -> None:
    """SIGKILL every process started with ``tag``, then the given launchers (reaped)."""
    for pid in processes_with(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def finish(procs: Sequence[subprocess.Popen[str]], tag: str, timeout: float) -> list[tuple[int | None, str]]:
    """Wait for every launcher (``timeout`` seconds in all); SIGTERM the late ones, then kill everything tagged."""
    import time

    deadline = time.monotonic() + timeout
    results: list[tuple[int | None, str]] = []
    try:
        for proc in procs:
            try:
                output, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGTERM)  # the launcher stops its groups and the Lighthouse
                try:
                    output, _ = proc.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    output = ""
            results.append((proc.returncode, output or ""))
    finally:
        kill_tagged(tag, procs)
    return results


def run_launch(out: Path, script: Path, *flags: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``hasten launch --cpu FLAGS script`` on this machine with ``FT_OUT=out`` (output merged into stdout);
    every process it started is gone afterwards."""
    tag = new_tag()
    proc = subprocess.Popen([*launch_argv(*flags), str(script)], env=launch_env(tag, {"FT_OUT": str(out)}),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    code, output = finish([proc], tag, timeout)[0]
    return subprocess.CompletedProcess(proc.args, code if code is not None else -1, output, "")


__all__ = ["ROOT", "TAG_VAR", "finish", "kill_tagged", "launch_argv", "launch_env", "new_tag", "processes_with",
           "run_launch", "torchft_python"]
