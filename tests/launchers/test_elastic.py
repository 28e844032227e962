"""Elastic restart: a worker group restarted by `hasten launch --max_restarts` resumes from its newest
checkpoint and ends with exactly the weights of an uninterrupted run."""

import os
import subprocess
import sys

import pytest
import torch

from helpers.launch_scripts import RESUMING_TRAINER as SCRIPT


@pytest.mark.launch
def test_restart_resumes_from_newest_checkpoint(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    hasten = [sys.executable, "-m", "hasten.commands.main", "launch", "--cpu", "--num_processes", "2"]
    marker = tmp_path / "crashed"
    crashed = subprocess.run(hasten + ["--max_restarts", "1", str(script), str(tmp_path / "a"), str(tmp_path / "a.pt"),
                                       str(marker)], env=env, capture_output=True, text=True, timeout=300)
    assert crashed.returncode == 0, crashed.stdout + crashed.stderr
    assert marker.exists() and "resumed from checkpoint_1" in crashed.stdout
    clean = subprocess.run(hasten + [str(script), str(tmp_path / "b"), str(tmp_path / "b.pt"), "-"], env=env,
                           capture_output=True, text=True, timeout=300)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    for a, b in zip(torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")):
        assert torch.equal(a, b)
