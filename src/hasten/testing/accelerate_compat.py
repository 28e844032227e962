"""Accelerate's public test helpers (``accelerate.test_utils``), so users' own test suites port over.

A regression model and dataset with a known answer, ``require_*`` decorators that skip a test when the
hardware or package is missing, and subprocess helpers that run ``hasten launch``.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
import unittest
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from hasten.base import imports


class RegressionDataset(Dataset):  # type: ignore[type-arg]
    """``length`` samples of ``y = a * x + b`` plus a little noise, ``x`` drawn from a normal distribution.

    Items are dicts ``{"x": float32, "y": float32}``; the same ``seed`` gives the same data.
    """

    def __init__(self, a: float = 2, b: float = 3, length: int = 64, seed: int | None = None) -> None:
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.length = length
        self.x = torch.randn(length, generator=generator)
        self.y = a * self.x + b + 0.1 * torch.randn(length, generator=generator)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index], "y": self.y[index]}


class RegressionModel(nn.Module):
    """``x * a + b`` with two scalar parameters (``double_output`` returns the result twice)."""

    def __init__(self, a: float = 0, b: float = 0, double_output: bool = False) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor(float(a)))
        self.b = nn.Parameter(torch.tensor(float(b)))
        self.double_output = double_output
        self.first_batch = True

    def forward(self, x: torch.Tensor | None = None) -> Any:
        if self.first_batch:
            self.first_batch = False
        if x is None:  # None is Accelerate's default, but the model needs an input
            raise TypeError("RegressionModel.forward needs the input tensor `x`")
        out = x * self.a + self.b
        return (out, out) if self.double_output else out


# ------------------------------------------------------------------------------------------- decorators
def _skip_unless(condition: bool, reason: str) -> Callable[[Any], Any]:
    return unittest.skipUnless(condition, reason)


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _xpu_count() -> int:
    return torch.xpu.device_count() if imports.is_xpu_available() else 0


def skip(test_case: Any) -> Any:
    """Always skip the test."""
    return unittest.skip("test was skipped")(test_case)


def slow(test_case: Any) -> Any:
    """Run the test only with ``RUN_SLOW=1``."""
    return _skip_unless(os.environ.get("RUN_SLOW", "0").lower() in ("1", "true", "yes"), "test is slow")(test_case)


def run_first(test_case: Any) -> Any:
    """Order the test first when pytest-order is installed (otherwise a no-op)."""
    try:
        import pytest

        return pytest.mark.order(1)(test_case)
    except (ImportError, AttributeError):
        return test_case


def require_cpu(test_case: Any) -> Any:
    """Run only when no accelerator is present."""
    return _skip_unless(not torch.cuda.is_available() and not imports.is_xpu_available(), "test requires only a CPU")(test_case)


def require_non_cpu(test_case: Any) -> Any:
    """Run only with an accelerator (GPU)."""
    return _skip_unless(torch.cuda.is_available() or imports.is_xpu_available(), "test requires a GPU")(test_case)


def require_cuda(test_case: Any) -> Any:
    """Run only with a CUDA GPU."""
    return _skip_unless(torch.cuda.is_available(), "test requires a CUDA GPU")(test_case)


def require_cuda_or_xpu(test_case: Any) -> Any:
    return _skip_unless(torch.cuda.is_available() or imports.is_xpu_available(), "test requires CUDA or XPU")(test_case)


def require_cuda_or_hpu(test_case: Any) -> Any:
    return _skip_unless(torch.cuda.is_available() or imports.is_hpu_available(), "test requires CUDA or HPU")(test_case)


def require_xpu(test_case: Any) -> Any:
    return _skip_unless(imports.is_xpu_available(), "test requires an XPU")(test_case)


def require_non_xpu(test_case: Any) -> Any:
    return _skip_unless(not imports.is_xpu_available(), "test requires a non-XPU machine")(test_case)


def require_non_hpu(test_case: Any) -> Any:
    return _skip_unless(not imports.is_hpu_available(), "test requires a non-HPU machine")(test_case)


def require_mps(test_case: Any) -> Any:
    return _skip_unless(imports.is_mps_available(), "test requires Apple MPS")(test_case)


def require_npu(test_case: Any) -> Any:
    return _skip_unless(imports.is_npu_available(), "test requires an NPU")(test_case)


def require_mlu(test_case: Any) -> Any:
    return _skip_unless(imports.is_mlu_available(), "test requires an MLU")(test_case)


def require_musa(test_case: Any) -> Any:
    return _skip_unless(imports.is_musa_available(), "test requires a MUSA device")(test_case)


def require_sdaa(test_case: Any) -> Any:
    return _skip_unless(imports.is_sdaa_available(), "test requires an SDAA device")(test_case)


def require_tpu(test_case: Any) -> Any:
    return _skip_unless(imports.is_torch_xla_available(check_is_tpu=True), "test requires a TPU")(test_case)


def require_non_torch_xla(test_case: Any) -> Any:
    return _skip_unless(not imports.is_torch_xla_available(), "test requires a machine without torch_xla")(test_case)


def require_single_device(test_case: Any) -> Any:
    return _skip_unless(_cuda_count() + _xpu_count() == 1, "test requires exactly one accelerator")(test_case)


def require_single_gpu(test_case: Any) -> Any:
    return _skip_unless(_cuda_count() == 1, "test requires exactly one GPU")(test_case)


def require_single_xpu(test_case: Any) -> Any:
    return _skip_unless(_xpu_count() == 1, "test requires exactly one XPU")(test_case)


def require_multi_device(test_case: Any) -> Any:
    return _skip_unless(max(_cuda_count(), _xpu_count()) > 1, "test requires several accelerators")(test_case)


def require_multi_gpu(test_case: Any) -> Any:
    return _skip_unless(_cuda_count() > 1, "test requires several GPUs")(test_case)


def require_multi_xpu(test_case: Any) -> Any:
    return _skip_unless(_xpu_count() > 1, "test requires several XPUs")(test_case)


def require_multi_gpu_or_xpu(test_case: Any) -> Any:
    return _skip_unless(_cuda_count() > 1 or _xpu_count() > 1, "test requires several GPUs or XPUs")(test_case)


def require_fp16(test_case: Any) -> Any:
    return _skip_unless(imports.is_fp16_available(), "test requires fp16")(test_case)


def require_fp8(test_case: Any) -> Any:
    return _skip_unless(imports.is_fp8_available(), "test requires fp8 (torchao and a GPU of compute capability >= 8.9)")(test_case)


def require_bnb(test_case: Any) -> Any:
    return _skip_unless(imports.is_bnb_available(), "test requires bitsandbytes")(test_case)


def require_torchao(test_case: Any) -> Any:
    return _skip_unless(imports.is_torchao_available(), "test requires torchao")(test_case)


def require_torchvision(test_case: Any) -> Any:
    return _skip_unless(imports.is_torchvision_available(), "test requires torchvision")(test_case)


def require_transformer_engine(test_case: Any) -> Any:
    return _skip_unless(imports.is_transformer_engine_available(), "test requires Transformer Engine")(test_case)


def require_transformer_engine_mxfp8(test_case: Any) -> Any:
    return _skip_unless(imports.is_transformer_engine_mxfp8_available(), "test requires Transformer Engine MXFP8")(test_case)


def require_pippy(test_case: Any) -> Any:
    return _skip_unless(imports.is_pippy_available(), "test requires torch.distributed.pipelining")(test_case)


def require_huggingface_suite(test_case: Any) -> Any:
    available = imports.is_transformers_available() and imports.is_datasets_available()
    return _skip_unless(available, "test requires transformers and datasets")(test_case)


def require_torch_min_version(test_case: Any = None, version: str | None = None) -> Any:
    """Skip unless torch is at least ``version`` (usable as ``@require_torch_min_version(version="2.4")``)."""
    if test_case is None:
        return lambda case: require_torch_min_version(case, version=version)
    return _skip_unless(imports.is_torch_version(">=", str(version)), f"test requires torch >= {version}")(test_case)


# ------------------------------------------------------------------------------------- other helpers
def are_the_same_tensors(tensor: torch.Tensor) -> bool:
    """Whether every process holds the same tensor (gathers them)."""
    from hasten.ops.collectives import gather
    from hasten.state import PartialState

    state = PartialState()
    gathered = gather(tensor[None].clone().to(state.device)).cpu()
    return all(torch.equal(gathered[0], gathered[i]) for i in range(gathered.shape[0]))


@contextlib.contextmanager
def assert_exception(exception_class: type[BaseException], msg: str | None = None) -> Iterator[None]:
    """Assert that the block raises ``exception_class`` (whose message contains ``msg`` when given)."""
    try:
        yield
    except exception_class as error:
        if msg is not None and msg not in str(error):
            raise AssertionError(f"expected {exception_class.__name__} containing {msg!r}, got {error!r}") from error
        return
    raise AssertionError(f"expected {exception_class.__name__} to be raised")


def capture_call_output(func: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """What ``func(*args, **kwargs)`` prints to stdout."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        func(*args, **kwargs)
    return buffer.getvalue()


@dataclass
class SubprocessOutput:
    """What :func:`execute_subprocess_async` returns."""

    returncode: int
    stdout: list[str]
    stderr: list[str]


def execute_subprocess_async(cmd: list[str], env: dict[str, str] | None = None, stdin: Any = None,
                             timeout: float = 180, quiet: bool = False, echo: bool = True) -> SubprocessOutput:
    """Run ``cmd`` to completion (within ``timeout`` seconds) and return its output.

    Raises:
        RuntimeError: the command failed or wrote nothing; the message holds its stderr.
    """
    if echo:
        print("\nRunning:", " ".join(map(str, cmd)))
    result = subprocess.run(cmd, env=env, input=stdin, capture_output=True, text=True, timeout=timeout, check=False)
    out = SubprocessOutput(result.returncode, result.stdout.splitlines(), result.stderr.splitlines())
    if not quiet:
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
    if result.returncode != 0:
        raise RuntimeError(f"'{' '.join(map(str, cmd))}' failed with returncode {result.returncode}\n\n"
                           f"The combined stderr from workers follows:\n{result.stderr}")
    if not result.stdout and not result.stderr:
        raise RuntimeError(f"'{' '.join(map(str, cmd))}' produced no output.")
    return out


def get_launch_command(**kwargs: Any) -> list[str]:
    """``hasten launch`` with ``--key=value`` options, ready to extend with a script and its arguments."""
    base = ["hasten", "launch"] if shutil.which("hasten") else [sys.executable, "-m", "hasten.commands.main", "launch"]
    return base + [f"--{key}={value}" for key, value in kwargs.items() if value is not None]


def path_in_accelerate_package(*components: str) -> Path:
    """A path inside the installed hasten package."""
    import hasten

    return Path(hasten.__file__).parent.joinpath(*components)


def pytest_xdist_worker_id() -> int:
    """This pytest-xdist worker's number (0 without xdist)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    digits = "".join(ch for ch in worker if ch.isdigit())
    return int(digits or 0)


def get_torch_dist_unique_port() -> int:
    """A rendezvous port that differs per pytest-xdist worker (29500 + worker number)."""
    return 29500 + pytest_xdist_worker_id()


def memory_allocated_func() -> int | None:
    """Bytes allocated on the current accelerator (None without one)."""
    if torch.cuda.is_available():
        return torch.cuda.memory_allocated()
    if imports.is_xpu_available():
        return torch.xpu.memory_allocated()
    return None


__all__ = [
    "RegressionDataset",
    "RegressionModel",
    "are_the_same_tensors",
    "assert_exception",
    "capture_call_output",
    "execute_subprocess_async",
    "get_launch_command",
    "get_torch_dist_unique_port",
    "memory_allocated_func",
    "path_in_accelerate_package",
    "pytest_xdist_worker_id",
    "require_bnb",
    "require_cpu",
    "require_cuda",
    "require_cuda_or_hpu",
    "require_cuda_or_xpu",
    "require_fp16",
    "require_fp8",
    "require_huggingface_suite",
    "require_mlu",
    "require_mps",
    "require_multi_device",
    "require_multi_gpu",
    "require_multi_gpu_or_xpu",
    "require_multi_xpu",
    "require_musa",
    "require_non_cpu",
    "require_non_hpu",
    "require_non_torch_xla",
    "require_non_xpu",
    "require_npu",
    "require_pippy",
    "require_sdaa",
    "require_single_device",
    "require_single_gpu",
    "require_single_xpu",
    "require_torch_min_version",
    "require_torchao",
    "require_torchvision",
    "require_tpu",
    "require_transformer_engine",
    "require_transformer_engine_mxfp8",
    "require_xpu",
    "run_first",
    "skip",
    "slow",
]
