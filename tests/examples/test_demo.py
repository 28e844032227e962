"""The README's demo: the MNIST BasicNet loop trained on 2 processes through `hasten launch`."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "mnist_digits.py"


@pytest.mark.launch
def test_mnist_demo_reaches_90_percent_on_two_processes():
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    run = subprocess.run([sys.executable, "-m", "hasten.commands.main", "launch", "--num_processes", "2",
                          str(EXAMPLE), "--epochs", "2"], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    accuracies = [float(a) for a in re.findall(r"test accuracy ([\d.]+)%", run.stdout)]
    assert len(accuracies) == 2 and "2 processes" in run.stdout, run.stdout  # printed once, by the main process
    assert accuracies[-1] >= 90.0, run.stdout
