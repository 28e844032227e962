"""Launch tests of replica groups (torchft): the interpreter that holds torchft, and a bounded ``hasten launch``.

torchft lives in its own venv (``make tft-venv``; ``make test`` passes its interpreter as HASTEN_TORCHFT_PYTHON).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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


def processes_with(tag: str) -> list[int]:
    """Processes whose environment holds ``tag`` (one launch's launcher, groups and workers)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if tag.encode() in f.read():
                        found.append(int(name))
            except OSError:
                continue
    return found


def kill_everything(tag: str, proc: subprocess.Popen) -> None:
    """SIGKILL every process started with ``tag`` (torchrun's workers run in sessions of their own) and the launcher."""
    for pid in processes_with(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def run_launch(out: Path, script: Path, *flags: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``hasten launch --cpu FLAGS SCRIPT`` with torchft's interpreter (``FT_OUT`` = ``out``); every process it
    started is gone afterwards."""
    name, value = "HASTEN_FT_TEST_RUN", uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "FT_OUT": str(out), name: value}
    proc = subprocess.Popen([torchft_python(), "-m", "hasten.commands.main", "launch", "--cpu", *flags, str(script)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the launcher stops its groups and the Lighthouse
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        kill_everything(f"{name}={value}", proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, output, "")
