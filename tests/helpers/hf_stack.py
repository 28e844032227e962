"""Shared by the Hugging Face stack tests: the interpreters that hold trl/peft (and the real Accelerate).

``make test`` builds them (``make hf-venv``): ``.hf-venv`` is layered over ``.venv`` with trl, peft,
diffusers and datasets; ``.hf-acc-venv`` is layered over that with Accelerate 1.15.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _interpreter(variable: str, folder: str) -> str:
    candidate = Path(os.environ.get(variable) or ROOT / folder / "bin" / "python")
    if not candidate.exists():
        pytest.fail(f"no interpreter at {candidate} (${variable}): run `make hf-venv` (`make test` builds it)")
    return str(candidate)


def hf_python() -> str:
    """The interpreter with transformers, trl, peft and datasets, and without Accelerate."""
    return _interpreter("HASTEN_HF_PYTHON", ".hf-venv")


def accelerate_python() -> str:
    """The same, plus the real Accelerate 1.15."""
    return _interpreter("HASTEN_HF_ACCELERATE_PYTHON", ".hf-acc-venv")


def hf_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """Offline, single-threaded, hasten from this checkout, no launch configuration inherited."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HASTEN_LAUNCH", "ACCELERATE_", "FSDP_"))}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), HASTEN_HOME=str(tmp_path / "home"),
               TOKENIZERS_PARALLELISM="false", WANDB_DISABLED="true", TMPDIR=str(tmp_path),
               PYTHONPATH=str(ROOT / "src"), DISABLE_MLFLOW_INTEGRATION="TRUE", **extra)
    return env


def run(argv: list[str], tmp_path: Path, timeout: int = 300, **extra: str) -> str:
    """Run ``argv`` in ``tmp_path``; fail with its output unless it exits 0; return the output."""
    out = subprocess.run(argv, cwd=tmp_path, env=hf_env(tmp_path, **extra), capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, f"{argv} exited {out.returncode}\n{out.stdout[-6000:]}\n{out.stderr[-8000:]}"
    return out.stdout


def script(tmp_path: Path, code: str, name: str = "script.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(code))
    return str(path)


def hasten_launch(tmp_path: Path, *argv: str, python: str | None = None, timeout: int = 300) -> str:
    """``hasten launch ARGV`` with the Hugging Face interpreter (its workers run that interpreter too)."""
    exe = python or hf_python()
    return run([exe, "-m", "hasten.commands.main", "launch", *argv], tmp_path, timeout=timeout)


__all__ = ["ROOT", "accelerate_python", "hasten_launch", "hf_env", "hf_python", "run", "script", "sys"]
