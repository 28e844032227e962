"""The ``hasten`` CLI: questionnaire through stdin, ``config default`` / ``update``, ``env``, light imports."""

import os
import subprocess
import sys

import yaml

from hasten.commands.main import main
from hasten.commands.questionnaire import Prompter, run_questionnaire
from hasten.config.io import load_config_file


def _answers(*lines):
    feed = iter(lines)

    def read(prompt):
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None
    return Prompter(read=read, write=lambda *a: None)


def test_questionnaire_through_stdin_writes_the_expected_file(tmp_path):
    target = tmp_path / "cfg.yaml"
    # multi-CPU, 2 machines, rank 1, main at 10.0.0.2:29555, same network, c10d, both machines must remain,
    # no debug, no mpirun, no dynamo, 4 processes, bf16
    answers = "1\n2\n1\n10.0.0.2\n29555\nyes\n1\n\nno\nno\nno\n4\n2\n"
    proc = subprocess.run([sys.executable, "-m", "hasten.commands.main", "config", "--config_file", str(target)],
                          input=answers, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, HASTEN_HOME=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(target.read_text()) == {
        "compute_environment": "LOCAL_MACHINE", "debug": False, "distributed_type": "MULTI_CPU",
        "downcast_bf16": False, "enable_cpu_affinity": False, "machine_rank": 1, "main_process_ip": "10.0.0.2",
        "main_process_port": 29555, "main_training_function": "main", "mixed_precision": "bf16", "num_machines": 2,
        "num_processes": 4, "rdzv_backend": "c10d", "same_network": True, "tpu_use_cluster": False,
        "tpu_use_sudo": False, "use_cpu": True}


def test_questionnaire_fsdp_and_defaults_at_end_of_input():
    cfg = run_questionnaire(_answers("2", "", "", "no", "no", "yes", "", "yes"))
    assert cfg["distributed_type"] == "FSDP" and cfg["fsdp_config"]["fsdp_offload_params"] is True
    assert cfg["fsdp_config"]["fsdp_version"] == 2 and cfg["num_processes"] == 2 and cfg["mixed_precision"] == "no"


def test_questionnaire_elastic_machines():
    # multi-CPU, 3 machines, rank 0, main at 10.0.0.2:29555, same network, c10d, 2 must remain
    cfg = run_questionnaire(_answers("1", "3", "0", "10.0.0.2", "29555", "yes", "1", "2"))
    assert (cfg["rdzv_backend"], cfg["num_machines"], cfg["min_machines"]) == ("c10d", 3, 2)


def test_questionnaire_asks_again_after_a_wrong_answer():
    cfg = run_questionnaire(_answers("7", "0", "maybe", "yes"))
    assert cfg["distributed_type"] == "NO" and cfg["use_cpu"] is True


def test_config_default_does_not_overwrite(tmp_path, capsys):
    target = tmp_path / "d.yaml"
    assert main(["config", "default", "--config_file", str(target), "--mixed_precision", "bf16"]) == 0
    config = load_config_file(target)
    assert config.mixed_precision == "bf16" and config.num_processes >= 1
    target.write_text("untouched")
    assert main(["config", "default", "--config_file", str(target)]) == 1
    assert target.read_text() == "untouched" and "already exists" in capsys.readouterr().err


def test_config_update_rewrites_legacy_keys(tmp_path):
    target = tmp_path / "old.yaml"
    target.write_text("distributed_type: FSDP\nfp16: true\nfsdp_config:\n  fsdp_backward_prefetch_policy: "
                      "BACKWARD_PRE\n  fsdp_version: 2\n")
    assert main(["config", "update", "--config_file", str(target)]) == 0
    data = yaml.safe_load(target.read_text())
    assert data["mixed_precision"] == "fp16" and "fp16" not in data
    assert data["fsdp_config"] == {"fsdp_backward_prefetch": "BACKWARD_PRE", "fsdp_version": 2}


def test_env_prints_versions_and_config(tmp_path, capsys):
    target = tmp_path / "c.yaml"
    target.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\n")
    assert main(["env", "--config_file", str(target)]) == 0
    out = capsys.readouterr().out
    import torch

    assert f"- PyTorch version: {torch.__version__}" in out and "- hasten version:" in out
    assert "- Python version:" in out and "\t- num_processes: 2" in out


def test_help_and_launch_parsing_stay_light(tmp_path):
    code = ("import sys\nfrom hasten.commands.main import build_parser\n"
            "build_parser().parse_args(['launch', '--cpu', 'x.py'])\n"
            "print(sorted(m for m in ('torch', 'numpy', 'yaml') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
    helped = subprocess.run([sys.executable, "-m", "hasten.commands.main", "launch", "--help"], capture_output=True,
                            text=True, timeout=60)
    assert helped.returncode == 0 and "--num-processes" in helped.stdout and "--num_processes" in helped.stdout
