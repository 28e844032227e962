"""The configuration file: Accelerate's format loads, round trips, bad input fails clearly, atomic writes."""

import json
import os

import pytest
import yaml

from hasten.config.io import default_config_file, find_config_file, load_config_file, save_config_file
from hasten.config.schema import LaunchConfig
from hasten.exceptions import ConfigurationError

# Files in the shapes Accelerate's questionnaire and documentation produce.
ACCELERATE_FILES = {
    "single_cpu": """
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: 'NO'
downcast_bf16: 'no'
machine_rank: 0
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 1
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
""",
    "multi_gpu": """
compute_environment: LOCAL_MACHINE
deepspeed_config: {}
distributed_type: MULTI_GPU
downcast_bf16: 'no'
fsdp_config: {}
gpu_ids: all
machine_rank: 0
main_process_ip: null
main_process_port: null
main_training_function: main
megatron_lm_config: {}
mixed_precision: fp16
num_machines: 1
num_processes: 4
rdzv_backend: static
same_network: true
use_cpu: false
""",
    "multi_node": """
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
gpu_ids: 0,1
machine_rank: 1
main_process_ip: 10.0.0.1
main_process_port: 29501
mixed_precision: bf16
num_machines: 2
num_processes: 4
rdzv_backend: c10d
same_network: false
use_cpu: false
""",
    "fsdp": """
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_transformer_layer_cls_to_wrap: BertLayer
  fsdp_version: 2
machine_rank: 0
mixed_precision: bf16
num_machines: 1
num_processes: 2
use_cpu: false
""",
    "deepspeed": """
compute_environment: LOCAL_MACHINE
deepspeed_config:
  gradient_accumulation_steps: 4
  gradient_clipping: 1.0
  offload_optimizer_device: cpu
  offload_param_device: none
  zero3_init_flag: true
  zero_stage: 3
distributed_type: DEEPSPEED
machine_rank: 0
mixed_precision: bf16
num_machines: 1
num_processes: 8
use_cpu: false
""",
    "mpi": """
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_CPU
mpirun_config:
  mpirun_ccl: '1'
  mpirun_hostfile: /home/user/hostfile
num_processes: 4
use_cpu: true
""",
}


def _normalised(data):
    """What Accelerate itself writes back: no None values, no empty blocks, bools for yes/no strings."""
    out = {k: v for k, v in data.items() if v is not None and v != {} and v != []}
    if out.get("downcast_bf16") == "no":
        out["downcast_bf16"] = False
    return out


@pytest.mark.parametrize("name", sorted(ACCELERATE_FILES))
def test_accelerate_files_load_and_round_trip(tmp_path, name):
    path = tmp_path / "default_config.yaml"
    path.write_text(ACCELERATE_FILES[name])
    config = load_config_file(path)
    original = yaml.safe_load(ACCELERATE_FILES[name])
    written = config.to_dict()
    assert {k: written[k] for k in _normalised(original)} == _normalised(original)
    # YAML -> LaunchConfig -> YAML -> LaunchConfig is stable.
    again = tmp_path / "again.yaml"
    save_config_file(config, again)
    assert load_config_file(again) == config
    assert yaml.safe_load(again.read_text()) == written


def test_json_file_and_legacy_keys_load(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU",
                                "fp16": True, "dynamo_backend": "INDUCTOR", "num_processes": -1}))
    config = load_config_file(path)
    assert config.mixed_precision == "fp16"
    assert config.dynamo_config == {"dynamo_backend": "INDUCTOR"}
    assert config.num_processes is None  # Accelerate's -1 = "not set"


def test_unknown_key_names_line_and_suggestion(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("distributed_type: 'NO'\nnum_proceses: 2\n")
    with pytest.raises(ConfigurationError, match=r"line 2: unknown key 'num_proceses' \(did you mean 'num_processes'"):
        load_config_file(path)


def test_unknown_block_key_is_rejected(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stag: 2\n")
    with pytest.raises(ConfigurationError, match="'zero_stag'.*did you mean 'zero_stage'"):
        load_config_file(path)


def test_malformed_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("distributed_type: 'NO'\nnum_processes: [1\nuse_cpu: true\n")
    with pytest.raises(ConfigurationError, match=r"c\.yaml, line \d+: malformed YAML"):
        load_config_file(path)


@pytest.mark.parametrize(("data", "pattern"), [
    ({"num_processes": "two"}, "num_processes='two' is not valid; expected an integer"),
    ({"use_cpu": "maybe"}, "use_cpu='maybe' is not valid; expected true or false"),
    ({"distributed_type": "MULTI_TPU"}, "distributed_type='MULTI_TPU' is not valid; expected one of"),
    ({"num_processes": 0}, "num_processes=0 must be at least 1"),
    ({"num_machines": 2, "machine_rank": 2}, "machine_rank=2 must be in 0..1"),
    ({"use_cpu": True, "gpu_ids": "0,1"}, "use_cpu=True conflicts with gpu_ids='0,1'"),
    ({"main_process_port": 70000}, "main_process_port=70000 is not a TCP port"),
    ({"compute_environment": "AMAZON_SAGEMAKER"}, "SageMaker launches are not supported"),
])
def test_bad_values_are_named(data, pattern):
    with pytest.raises(ConfigurationError, match=pattern):
        LaunchConfig.from_dict(data)


def test_default_location_follows_environment(tmp_path):
    assert default_config_file({"HASTEN_HOME": str(tmp_path)}) == tmp_path / "default_config.yaml"
    assert default_config_file({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "hasten" / "default_config.yaml"
    assert default_config_file({"HOME": str(tmp_path)}) == tmp_path / ".cache" / "hasten" / "default_config.yaml"
    assert find_config_file(None, {"HASTEN_HOME": str(tmp_path), "HOME": str(tmp_path)}) is None
    with pytest.raises(ConfigurationError, match="no such file"):
        find_config_file(tmp_path / "missing.yaml", {})


def test_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "default_config.yaml"
    save_config_file(LaunchConfig(num_processes=2), path)
    good = path.read_text()

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        save_config_file(LaunchConfig(num_processes=4), path)
    assert path.read_text() == good  # the old file is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["default_config.yaml"]  # no temporary left behind
