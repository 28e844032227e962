"""Every ``examples/by_feature`` script runs on tiny settings on two processes (``hasten launch``), and
where its one-process path differs (fp16 loss scaling, DeepSpeed, big-model dispatch, the notebook
launcher) on one (``python``) as well, and prints what it demonstrates; the checks below are each feature's ground truth
(e.g. ``gather_for_metrics`` counts every held-out sample exactly once, the dispatched big model
computes exactly what the ordinary model does, the simulated out-of-memory search ends at a batch that fits).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

FEATURES = Path(__file__).resolve().parents[2] / "examples" / "by_feature"
TEMPLATES = FEATURES.parent / "config_templates"


def run_feature(script: str, *args: str, cwd: Path, processes: int = 1, launch_args: tuple[str, ...] = (),
                timeout: int = 180) -> str:
    """Run ``examples/by_feature/<script>``; return its stdout after checking that it exited cleanly."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    path = str(FEATURES / script)
    if processes == 1:
        command = [sys.executable, path, *args]
    else:
        command = [sys.executable, "-m", "hasten.commands.main", "launch",
                   *(launch_args or ("--num_processes", str(processes))), path, *args]
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"exit {done.returncode}\nSTDOUT:\n{done.stdout[-3000:]}\nSTDERR:\n{done.stderr[-3000:]}"
    return done.stdout


PROCESSES = [1, pytest.param(2, marks=pytest.mark.launch)]
# Scripts whose one-process run checks nothing that their two-process run and the unit tests do not (the
# suite's time budget): they run under `hasten launch` only.
TWO = [pytest.param(2, marks=pytest.mark.launch)]
EPOCH_LINE = re.compile(r"^epoch \d+: accuracy [0-9.]+", re.MULTILINE)


def test_every_feature_script_has_a_header_and_a_test():
    scripts = sorted(p.stem for p in FEATURES.glob("*.py"))
    tested = {name[len("test_"):] for name in globals() if name.startswith("test_")}
    assert scripts and all(any(t.startswith(s) for t in tested) for s in scripts), (scripts, tested)
    for path in FEATURES.glob("*.py"):
        assert path.read_text().startswith('"""'), f"{path.name} lacks its header docstring"


@pytest.mark.parametrize("processes", PROCESSES)
def test_gradient_accumulation(tmp_path, processes):
    precision = ("--mixed_precision", "fp16", "--cpu") if processes == 1 else ()  # fp16 + loss scaling, on the CPU
    out = run_feature("gradient_accumulation.py", "--num_epochs", "1", "--gradient_accumulation_steps", "4",
                      *precision, cwd=tmp_path, processes=processes)
    steps, micro = map(int, re.search(r"\((\d+) optimizer steps for (\d+) micro-batches\)", out).groups())
    assert steps == -(-micro // 4)  # one step per 4 micro-batches, plus one at the end of the epoch


@pytest.mark.parametrize("processes", TWO)
def test_checkpointing(tmp_path, processes):
    first = run_feature("checkpointing.py", "--project_dir", "run", "--num_epochs", "2", cwd=tmp_path,
                        processes=processes)
    assert "saved run/checkpoints/checkpoint_1" in first
    if processes == 2:  # every process saved its random generators (resuming on two: see test_examples.py)
        assert (tmp_path / "run" / "checkpoints" / "checkpoint_1" / "random_states_1.pkl").is_file()
        return
    resumed = run_feature("checkpointing.py", "--project_dir", "run", "--num_epochs", "3", "--resume", cwd=tmp_path,
                          processes=processes)
    assert "resumed from run/checkpoints/checkpoint_1 after 2 epoch(s)" in resumed
    assert re.findall(r"^epoch (\d+)", resumed, re.MULTILINE) == ["2"]  # only the missing epoch runs
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["checkpoint_1", "checkpoint_2"]


@pytest.mark.parametrize("processes", TWO)
def test_tracking(tmp_path, processes):
    out = run_feature("tracking.py", "--report_to", "jsonl", "--project_dir", "logs", "--num_epochs", "1",
                      cwd=tmp_path, processes=processes)
    assert "logged to ['jsonl'] under logs" in out
    lines = (tmp_path / "logs" / "tracking_example" / "metrics.jsonl").read_text().splitlines()
    assert lines and '"accuracy"' in lines[-1]  # written once, by the main process
    assert (tmp_path / "logs" / "tracking_example" / "config.json").is_file()


@pytest.mark.parametrize("processes", TWO)
def test_memory(tmp_path, processes):
    out = run_feature("memory.py", "--num_epochs", "1", "--starting_batch_size", "128", "--simulated_memory", "100",
                      cwd=tmp_path, processes=processes)
    tried = [int(n) for n in re.findall(r"trying batch size (\d+)", out)]
    assert tried == [128, 115, 103, 92]  # 90% each time until it fits
    assert "with batch size 92" in out


@pytest.mark.parametrize("processes", TWO)
def test_multi_process_metrics(tmp_path, processes):
    out = run_feature("multi_process_metrics.py", "--num_epochs", "1", cwd=tmp_path, processes=processes)
    counted, gathered, size = map(int, re.search(r"over (\d+) samples \(gather alone returned (\d+); the data set "
                                                 r"has (\d+)\)", out).groups())
    assert counted == size == 359
    assert gathered == (359 if processes == 1 else 384)  # plain gather keeps the repeated padding samples


@pytest.mark.parametrize("processes", TWO)
def test_early_stopping(tmp_path, processes):
    out = run_feature("early_stopping.py", "--loss_threshold", "0.5", cwd=tmp_path, processes=processes)
    assert re.search(r"stopped early at step \d+ \(epoch 0\): accuracy [0-9.]+", out), out


@pytest.mark.parametrize("processes", TWO)
def test_local_sgd(tmp_path, processes):
    # The two-process run starts from the multi-CPU configuration template.
    launch = ("--config_file", str(TEMPLATES / "multi_cpu.yaml")) if processes == 2 else ()
    out = run_feature("local_sgd.py", "--num_epochs", "1", "--local_sgd_steps", "4", cwd=tmp_path,
                      processes=processes, launch_args=launch)
    assert len(EPOCH_LINE.findall(out)) == 1, out


@pytest.mark.parametrize("processes", TWO)
def test_profiler(tmp_path, processes):
    out = run_feature("profiler.py", "--num_steps", "6", "--output_trace_dir", "traces", cwd=tmp_path,
                      processes=processes)
    assert "Self CPU time total" in out and "aten::" in out
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == [f"profile_{i}.json" for i in range(processes)]


@pytest.mark.parametrize("processes", TWO)
def test_fsdp2(tmp_path, processes):
    out = run_feature("fsdp2.py", "--num_epochs", "1", "--output_dir", "model", cwd=tmp_path, processes=processes)
    assert re.search(rf"^epoch 0: accuracy [0-9.]+ \(FSDP, {processes} process\(es\)\)", out, re.MULTILINE), out
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "model" / "model.safetensors")
    assert weights["blocks.0.up.weight"].shape == (256, 64)  # the full, gathered tensor


@pytest.mark.launch
def test_deepspeed_zero_two_processes(tmp_path):
    out = run_feature("deepspeed_zero.py", "--num_epochs", "1", "--zero_stage", "3", cwd=tmp_path, processes=2)
    assert re.search(r"^epoch 0: accuracy [0-9.]+ \(ZeRO stage 3, 2 process\(es\)\)", out, re.MULTILINE), out


def test_deepspeed_zero_one_process(tmp_path):
    out = run_feature("deepspeed_zero.py", "--num_epochs", "1", "--zero_stage", "2", cwd=tmp_path)
    assert "(ZeRO stage 2, 1 process(es))" in out


@pytest.mark.parametrize("processes", PROCESSES)
def test_big_model_inference(tmp_path, processes):
    out = run_feature("big_model_inference.py", "--max_cpu_memory", "3MB", "--work_dir", "work", cwd=tmp_path,
                      processes=processes)
    assert "device map: 9 parts on ['cpu', 'disk']" in out  # part of the model had to go to disk
    assert f"16 inputs on {processes} process(es): max |dispatched - ordinary| = 0\n" in out
    assert any((tmp_path / "work" / "offload_0").iterdir())


@pytest.mark.parametrize("processes", PROCESSES)
def test_notebook_launch(tmp_path, processes):
    # This script starts its own processes with notebook_launcher: always run with plain python.
    done = subprocess.run([sys.executable, str(FEATURES / "notebook_launch.py"), "--num_processes", str(processes),
                           "--num_epochs", "1"], cwd=tmp_path, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(rf"^epoch 0: accuracy [0-9.]+ on {processes} process\(es\)$", done.stdout, re.MULTILINE)


@pytest.mark.launch
def test_nd_parallel_fsdp2_x_tp_on_four_processes(tmp_path):
    out = run_feature("nd_parallel.py", "--tp_size", "2", "--dp_shard_size", "2", "--num_epochs", "1", cwd=tmp_path,
                      processes=4, launch_args=("--cpu", "--num_processes", "4"), timeout=400)
    assert "mesh {'dp_shard': 2, 'tp': 2} over 4 processes" in out
    accuracy, total = re.search(r"sequence accuracy ([0-9.]+) over (\d+) held-out sequences", out).groups()
    assert int(total) == 100  # the TP pairs' duplicate batches are not counted twice
    assert float(accuracy) >= 0.9  # the counting task is learnt in one epoch (single process: 1.000)
