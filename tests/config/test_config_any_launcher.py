"""One configuration under any launcher: a process not started by ``hasten launch`` (plain torchrun, Ray, Kubeflow,
python) applies the configuration file ``hasten launch`` would read; code wins over the file and every
disagreement is reported once, in one line naming both values."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from hasten import Accelerator, ParallelismConfig
from hasten.config import env as hasten_env
from hasten.config.io import find_config_file, save_config_file
from hasten.config.schema import LaunchConfig
from hasten.connector import apply_config_file
from hasten.environments import ProcessInfo
from hasten.exceptions import ConfigurationError

FILE = LaunchConfig.from_dict({"distributed_type": "FSDP", "mixed_precision": "bf16", "num_processes": 4,
                               "use_cpu": True, "main_process_ip": "10.0.0.1", "main_process_port": 1234,
                               "fsdp_config": {"fsdp_version": 2}})


def _world(size, local=None, node=0):
    return ProcessInfo(rank=0, local_rank=0, world_size=size, local_world_size=local or size, node_rank=node,
                       master_addr="127.0.0.1", master_port=29500)


# ---------------------------------------------------------------------------------------------- the pure merge
def test_file_applies_where_code_is_silent_and_launcher_settings_are_not_applied():
    config, line = apply_config_file({}, FILE, "f.yaml", _world(4))
    assert line is None
    assert (config.mixed_precision, config.distributed_type, config.fsdp_config, config.use_cpu) == \
        ("bf16", "FSDP", {"fsdp_version": 2}, True)
    assert (config.num_processes, config.main_process_ip, config.main_process_port) == (None, None, None)


def test_code_wins_and_one_line_names_both_values_and_the_world():
    config, line = apply_config_file({"mixed_precision": "fp16"}, FILE, "/etc/f.yaml", _world(2))
    assert config.mixed_precision == "no"  # the code's value is the only one left to apply
    assert line.count("\n") == 0 and line.startswith("hasten: the configuration file /etc/f.yaml")
    assert "mixed_precision is 'bf16' in the file and 'fp16' in code: code wins" in line
    assert "num_processes is 4 in the file but this run has 2 processes: the launcher's count is used" in line
    assert "precedence: Accelerator(...) arguments > configuration file" in line


def test_equal_values_are_no_conflict():
    assert apply_config_file({"mixed_precision": "bf16"}, FILE, "f", _world(4))[1] is None


def test_an_engine_plugin_in_code_replaces_the_file_engine():
    config, line = apply_config_file({"deepspeed_plugin": object()}, FILE, "f", _world(4))
    assert "the engine is FSDP (fsdp_config) in the file and Accelerator(deepspeed_plugin=...) in code" in line
    assert config.distributed_type == "NO" and config.fsdp_config == {}


def test_accumulation_and_parallelism_conflicts_are_named():
    deepspeed = LaunchConfig.from_dict({"distributed_type": "DEEPSPEED",
                                        "deepspeed_config": {"gradient_accumulation_steps": 4, "zero_stage": 2}})
    config, line = apply_config_file({"gradient_accumulation_steps": 2}, deepspeed, "f", _world(1))
    assert "gradient_accumulation_steps is 4 in the file (deepspeed_config) and 2 in code: code wins" in line
    assert config.deepspeed_config == {"zero_stage": 2}
    mesh = LaunchConfig.from_dict({"parallelism_config": {"parallelism_config_tp_size": 2,
                                                          "parallelism_config_dp_shard_size": 2}})
    _, line = apply_config_file({"parallelism_config": ParallelismConfig(tp_size=4)}, mesh, "f", _world(4))
    assert "parallelism_config.tp_size is 2 in the file and 4 in code: code wins" in line
    assert "dp_shard_size" not in line  # left unset in code: the file fills it, no conflict


def test_settings_hasten_never_runs_are_reported_not_dropped():
    tpu = LaunchConfig.from_dict({"tpu_name": "pod", "downcast_bf16": True, "megatron_lm_config": {"megatron_lm_tp_degree": 2}})
    _, line = apply_config_file({}, tpu, "f", _world(1))
    assert "megatron_lm_config, tpu_name, downcast_bf16 are set in the file, but hasten does not run" in line


def test_machine_count_and_rank_mismatches_are_reported():
    two = LaunchConfig(num_machines=2, machine_rank=0, num_processes=4)
    _, line = apply_config_file({}, two, "f", _world(4, local=2, node=1))
    assert "machine_rank is 0 in the file but this machine is 1" in line
    _, line = apply_config_file({}, two, "f", _world(2))
    assert "num_machines is 2 in the file but this run has 1" in line


# ---------------------------------------------------------------------------------------------- finding the file
def test_accelerate_config_file_names_the_file(tmp_path):
    named = save_config_file(LaunchConfig(mixed_precision="bf16"), tmp_path / "mine.yaml")
    env = {"ACCELERATE_CONFIG_FILE": str(named), "HASTEN_HOME": str(tmp_path / "home")}
    assert find_config_file(None, env) == named
    assert hasten_env.worker_config_file(env)[1].mixed_precision == "bf16"
    # hasten launch's workers have the configuration already: they never read the file again
    assert hasten_env.worker_config_file({**env, "HASTEN_LAUNCH_CONFIG": "{}"}) is None
    with pytest.raises(ConfigurationError, match="ACCELERATE_CONFIG_FILE='/nonexistent.yaml': no such file"):
        find_config_file(None, {"ACCELERATE_CONFIG_FILE": "/nonexistent.yaml"})


def test_hasten_launch_reads_the_same_file(tmp_path):
    import argparse

    from hasten.commands.launch import build_launch_parser, resolve_config

    named = save_config_file(LaunchConfig(mixed_precision="bf16", num_processes=2), tmp_path / "named.yaml")
    args = build_launch_parser(argparse.ArgumentParser()).parse_args(["train.py"])
    config = resolve_config(args, {"ACCELERATE_CONFIG_FILE": str(named), "HASTEN_HOME": str(tmp_path / "home")})
    assert (config.mixed_precision, config.num_processes) == ("bf16", 2)


def test_a_bare_accelerator_applies_the_default_file(tmp_path, monkeypatch):
    save_config_file(LaunchConfig(mixed_precision="bf16", use_cpu=True), tmp_path / "home" / "default_config.yaml")
    monkeypatch.setenv("HASTEN_HOME", str(tmp_path / "home"))
    for key in ("HASTEN_LAUNCH_CONFIG", "ACCELERATE_CONFIG_FILE"):
        monkeypatch.delenv(key, raising=False)
    accelerator = Accelerator()
    assert accelerator.mixed_precision == "bf16" and accelerator.device.type == "cpu"


# ---------------------------------------------------------------------------------------------- plain torchrun
CHECK = textwrap.dedent("""
    import json, sys
    import torch
    from hasten import Accelerator

    accelerator = Accelerator(**json.loads(sys.argv[1]))
    model = torch.nn.Linear(8, 4)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    weight = model.weight
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    # a file per rank: two ranks' printed lines can interleave on the shared stdout
    with open(f"state_{accelerator.process_index}.json", "w") as out:
        json.dump({"rank": accelerator.process_index, "world": accelerator.num_processes,
                   "mixed_precision": accelerator.mixed_precision, "distributed_type": str(accelerator.distributed_type),
                   "sharded_rows": local.shape[0], "device": accelerator.device.type}, out)
""")


def _torchrun(tmp_path, arguments):
    script = tmp_path / "check.py"
    script.write_text(CHECK)
    config = tmp_path / "fsdp2_bf16.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nmixed_precision: bf16\n"
                      "num_processes: 4\nuse_cpu: true\nfsdp_config:\n  fsdp_version: 2\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HASTEN_", "ACCELERATE_"))}
    env.update(ACCELERATE_CONFIG_FILE=str(config), HASTEN_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1",
               TMPDIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script), json.dumps(arguments)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    states = [json.loads(path.read_text()) for path in tmp_path.glob("state_*.json")]
    return sorted(states, key=lambda s: s["rank"]), done.stderr


@pytest.mark.launch
def test_plain_torchrun_honours_the_named_config_file(tmp_path):
    states, err = _torchrun(tmp_path, {})
    assert len(states) == 2
    for state in states:  # FSDP2 really shards: each of the 2 ranks holds half of the 4 rows
        assert (state["world"], state["mixed_precision"], state["distributed_type"], state["sharded_rows"],
                state["device"]) == (2, "bf16", "FSDP", 2, "cpu")
    # the file's num_processes (4) is the launcher's business: not applied, and the mismatch said once
    assert err.count("num_processes is 4 in the file but this run has 2 processes") == 1, err


@pytest.mark.launch
def test_plain_torchrun_reports_a_conflict_once_and_code_wins(tmp_path):
    states, err = _torchrun(tmp_path, {"mixed_precision": "fp16"})
    assert [s["mixed_precision"] for s in states] == ["fp16", "fp16"]
    lines = [line for line in err.splitlines() if "and this run disagree" in line]
    assert len(lines) == 1, err
    assert "mixed_precision is 'bf16' in the file and 'fp16' in code: code wins" in lines[0]
