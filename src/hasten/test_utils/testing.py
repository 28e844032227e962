"""Accelerate's ``accelerate.test_utils.testing``: the decorators, ``TestCase`` bases and subprocess helpers
that test suites written for Accelerate import.

The regression model, the hardware ``require_*`` decorators and the launch helpers are
:mod:`hasten.testing.accelerate_compat`'s (re-exported here); this module adds the package decorators,
the device facts (``torch_device``, ``device_count``), ``DEFAULT_LAUNCH_COMMAND`` and the test-case
bases.

Example:
    >>> from hasten.test_utils.testing import AccelerateTestCase, assert_exception, require_cpu
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import unittest
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hasten._lazy import accelerate_path_getattr
from hasten.base import imports
from hasten.base.environment import parse_flag_from_env
from hasten.state import AcceleratorState, GradientState
from hasten.testing import accelerate_compat as _compat
from hasten.testing.accelerate_compat import *  # noqa: F403  (Accelerate's names, one definition each)
from hasten.testing.accelerate_compat import get_launch_command


def get_backend() -> tuple[str, int, Callable[[], int]]:
    """``(device type, device count, allocated-memory function)`` of this machine, as Accelerate reports
    them: ``("cuda", n, torch.cuda.memory_allocated)`` with GPUs, else ``("cpu", 1, lambda: 0)``."""
    if torch.cuda.is_available():
        return "cuda", torch.cuda.device_count(), torch.cuda.memory_allocated
    if imports.is_xpu_available():
        return "xpu", torch.xpu.device_count(), torch.xpu.memory_allocated
    if imports.is_mps_available():
        return "mps", 1, torch.mps.current_allocated_memory
    return "cpu", 1, lambda: 0


torch_device, device_count, memory_allocated_func = get_backend()

#: ``hasten launch`` on every device of this machine, as Accelerate's test suites start their scripts.
DEFAULT_LAUNCH_COMMAND: list[str] = get_launch_command(num_processes=device_count, monitor_interval=0.1)


def _needs(available: bool, what: str) -> Callable[[Any], Any]:
    return unittest.skipUnless(available, f"test requires {what}")


def _package_decorator(check: str, what: str) -> Callable[[Any], Any]:
    def decorator(test_case: Any) -> Any:
        return _needs(getattr(imports, check)(), what)(test_case)

    decorator.__doc__ = f"Skip the test unless {what} is installed."
    return decorator


require_deepspeed = _package_decorator("is_deepspeed_available", "DeepSpeed")
require_peft = _package_decorator("is_peft_available", "peft")
require_datasets = _package_decorator("is_datasets_available", "datasets")
require_transformers = _package_decorator("is_transformers_available", "transformers")
require_timm = _package_decorator("is_timm_available", "timm")
require_triton = _package_decorator("is_triton_available", "triton")
require_schedulefree = _package_decorator("is_schedulefree_available", "schedulefree")
require_tensorboard = _package_decorator("is_tensorboard_available", "tensorboard")
require_wandb = _package_decorator("is_wandb_available", "wandb")
require_trackio = _package_decorator("is_trackio_available", "trackio")
require_comet_ml = _package_decorator("is_comet_ml_available", "comet_ml")
require_aim = _package_decorator("is_aim_available", "aim")
require_clearml = _package_decorator("is_clearml_available", "clearml")
require_dvclive = _package_decorator("is_dvclive_available", "dvclive")
require_swanlab = _package_decorator("is_swanlab_available", "swanlab")
require_pandas = _package_decorator("is_pandas_available", "pandas")
require_mlflow = _package_decorator("is_mlflow_available", "mlflow")
require_import_timer = _package_decorator("is_import_timer_available", "import_timer")
require_matplotlib = _package_decorator("is_matplotlib_available", "matplotlib")
require_neuron = _package_decorator("is_neuron_available", "AWS Neuron")
require_torchdata_stateful_dataloader = _package_decorator("is_torchdata_stateful_dataloader_available",
                                                           "torchdata.stateful_dataloader")


def require_fsdp2(test_case: Any) -> Any:
    """Skip the test unless torch has FSDP2 (``fully_shard``, torch 2.6 or newer)."""
    return _needs(imports.is_torch_version(">=", "2.6.0"), "torch version >= 2.6.0")(test_case)


def require_tp(test_case: Any) -> Any:
    """Skip the test unless torch >= 2.3 and transformers >= 4.52 (tensor parallelism) are installed."""
    available = imports.is_torch_version(">=", "2.3.0") and imports.is_transformers_available() and \
        imports.compare_versions("transformers", ">=", "4.52.0")
    return _needs(available, "torch version >= 2.3.0 and transformers version >= 4.52.0")(test_case)


def require_trackers(test_case: Any) -> Any:
    """Skip the test unless a tracker package is installed (and ``comet_ml`` is not, as in Accelerate)."""
    available = any([imports.is_wandb_available(), imports.is_tensorboard_available(),
                     imports.is_trackio_available(), imports.is_swanlab_available()])
    return _needs(available and not imports.is_comet_ml_available(),
                  "at least one tracker to be available and for `comet_ml` to not be installed")(test_case)


class TempDirTestCase(unittest.TestCase):
    """A ``TestCase`` with one temporary folder for the whole class (``self.tmpdir``), emptied before each
    test when ``clear_on_setup`` is True and removed after the class."""

    clear_on_setup = True
    tmpdir: Path

    @classmethod
    def setUpClass(cls) -> None:
        cls.tmpdir = Path(tempfile.mkdtemp())

    @classmethod
    def tearDownClass(cls) -> None:
        if os.path.exists(cls.tmpdir):
            shutil.rmtree(cls.tmpdir)

    def setUp(self) -> None:
        if self.clear_on_setup:
            for path in self.tmpdir.glob("**/*"):
                if path.is_file():
                    path.unlink()
                elif path.is_dir():
                    shutil.rmtree(path)


class AccelerateTestCase(unittest.TestCase):
    """A ``TestCase`` that resets the shared ``AcceleratorState`` and ``GradientState`` after every test, so
    one test's ``Accelerator`` never leaks into the next."""

    def tearDown(self) -> None:
        super().tearDown()
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


class MockingTestCase(unittest.TestCase):
    """A ``TestCase`` that starts mocks for every test: call ``self.add_mocks(...)`` at the end of ``setUp``."""

    def add_mocks(self, mocks: Any) -> None:
        """Start ``mocks`` (one or a list) now and stop them when the test ends."""
        self.mocks = mocks if isinstance(mocks, (tuple, list)) else [mocks]
        for patcher in self.mocks:
            patcher.start()
            self.addCleanup(patcher.stop)


class SubprocessCallException(Exception):
    """:func:`run_command`'s command failed; the message holds its output."""


def run_command(command: list[Any], return_stdout: bool = False, env: dict[str, str] | None = None) -> Any:
    """Run ``command`` (paths allowed) and return its output as text when ``return_stdout``; a failure raises
    :class:`SubprocessCallException` with the command's combined output."""
    command = [str(part) if isinstance(part, Path) else part for part in command]
    try:
        output = subprocess.check_output(command, stderr=subprocess.STDOUT,
                                         env=os.environ.copy() if env is None else env)
    except subprocess.CalledProcessError as error:
        raise SubprocessCallException(f"Command `{' '.join(command)}` failed with the following error:\n\n"
                                      f"{error.output.decode()}") from error
    return output.decode("utf-8") if return_stdout else None


__all__ = [*_compat.__all__, "AccelerateTestCase", "DEFAULT_LAUNCH_COMMAND", "MockingTestCase",
           "SubprocessCallException", "TempDirTestCase", "device_count", "get_backend",
           "parse_flag_from_env", "require_aim", "require_clearml", "require_comet_ml", "require_datasets",
           "require_deepspeed", "require_dvclive", "require_fsdp2", "require_import_timer", "require_matplotlib",
           "require_mlflow", "require_neuron", "require_pandas", "require_peft", "require_schedulefree",
           "require_swanlab", "require_tensorboard", "require_timm", "require_torchdata_stateful_dataloader",
           "require_tp", "require_trackers", "require_trackio", "require_transformers", "require_triton",
           "require_wandb", "run_command", "torch_device"]

# Names Accelerate's module at this path shows but defines elsewhere (hasten/_accelerate_shown.py).
__getattr__ = accelerate_path_getattr(__name__, globals())
