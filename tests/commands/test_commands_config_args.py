"""Accelerate's ``accelerate.commands.config`` package: the names ``transformers env`` and ``trl env`` read
(``default_config_file``, ``load_config_from_file``), the file as dataclasses, and the subcommand modules."""

import argparse
import dataclasses
import json

import pytest

from hasten.commands.config import (
    cluster,
    config,
    config_args,
    default,
    default_config_file,
    get_config_parser,
    load_config_from_file,
    sagemaker,
    update,
)
from hasten.commands.questionnaire import Prompter
from hasten.config.schema import LaunchConfig
from hasten.exceptions import ConfigurationError
from hasten.utils.constants import SageMakerDistributedType
from hasten.utils.dataclasses import ComputeEnvironment, DistributedType


def test_default_config_file_is_a_str_path():
    assert isinstance(default_config_file, str) and default_config_file.endswith("default_config.yaml")


def test_load_config_from_file_gives_the_validated_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nmixed_precision: bf16\nuse_cpu: true\n")
    config = load_config_from_file(str(path))
    assert isinstance(config, config_args.ClusterConfig) and isinstance(config, config_args.BaseConfig)
    data = config.to_dict()
    assert data["distributed_type"] == "MULTI_CPU" and data["mixed_precision"] == "bf16" and data["num_processes"] == 2
    assert config.mixed_precision == "bf16" and config.not_a_key is None  # unset keys read as None
    copy = tmp_path / "copy.yaml"
    config.to_yaml_file(str(copy))
    assert load_config_from_file(str(copy)) == config
    sagemaker = tmp_path / "s.yaml"
    sagemaker.write_text("compute_environment: AMAZON_SAGEMAKER\ndistributed_type: DATA_PARALLEL\n")
    assert isinstance(load_config_from_file(str(sagemaker)), config_args.SageMakerConfig)


def test_missing_and_invalid_files_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml` does not exist"):
        load_config_from_file(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("distributed_type: MULTI_CPU\nnum_procs: 2\n")
    with pytest.raises(ConfigurationError, match="num_procs"):
        load_config_from_file(str(bad))


# ------------------------------------------------------------------ Accelerate's modules of the package
BASE = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "mixed_precision": "bf16",
        "use_cpu": False, "debug": False}


def test_cluster_config_fields_are_the_launch_keys():
    # one key set: what ClusterConfig holds is what `hasten launch` reads (LaunchConfig)
    fields = {f.name for f in dataclasses.fields(config_args.ClusterConfig)}
    assert fields == {f.name for f in dataclasses.fields(LaunchConfig)}


def test_cluster_config_is_accelerates_dataclass():
    cfg = config_args.ClusterConfig(**BASE, num_processes=4)
    assert cfg.compute_environment is ComputeEnvironment.LOCAL_MACHINE
    assert cfg.distributed_type is DistributedType.MULTI_GPU
    assert cfg.fsdp_config == {} and cfg.dynamo_config == {} and cfg.rdzv_backend == "static"
    data = cfg.to_dict()
    assert data["distributed_type"] == "MULTI_GPU" and data["num_processes"] == 4 and "fsdp_config" not in data
    with pytest.raises(TypeError):
        config_args.ClusterConfig(distributed_type="NO")  # the five base keys are required, as in Accelerate


def test_json_and_yaml_round_trips_are_validated(tmp_path):
    cfg = config_args.ClusterConfig(**BASE, num_processes=2, fsdp_config={"fsdp_version": 2})
    cfg.to_json_file(str(tmp_path / "c.json"))
    assert json.loads((tmp_path / "c.json").read_text())["fsdp_config"] == {"fsdp_version": 2}
    assert config_args.ClusterConfig.from_json_file(str(tmp_path / "c.json")) == cfg
    cfg.to_yaml_file(str(tmp_path / "c.yml"))
    assert config_args.ClusterConfig.from_yaml_file(str(tmp_path / "c.yml")) == cfg
    assert load_config_from_file(str(tmp_path / "c.json")) == cfg
    with pytest.raises(ConfigurationError, match="num_processes=0"):
        config_args.ClusterConfig(**BASE, num_processes=0).to_yaml_file(str(tmp_path / "bad.yaml"))
    assert not (tmp_path / "bad.yaml").exists()


def test_sagemaker_files_are_read_not_launched(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("compute_environment: AMAZON_SAGEMAKER\ndistributed_type: DATA_PARALLEL\n"
                    "ec2_instance_type: ml.p3.2xlarge\niam_role_name: role\n")
    cfg = load_config_from_file(str(path))
    assert cfg.distributed_type is SageMakerDistributedType.DATA_PARALLEL and cfg.region == "us-east-1"
    assert cfg.to_dict()["ec2_instance_type"] == "ml.p3.2xlarge"
    with pytest.raises(ConfigurationError, match="SageMaker"):
        cfg.to_yaml_file(str(tmp_path / "out.yaml"))
    with pytest.raises(ConfigurationError, match="get_sagemaker_input.*SageMaker"):
        sagemaker.get_sagemaker_input()
    path.write_text("compute_environment: AMAZON_SAGEMAKER\ndistributed_type: 'NO'\nregoin: x\n")
    with pytest.raises(ConfigurationError, match="regoin"):
        load_config_from_file(str(path))


def test_get_cluster_input_asks_the_questionnaire():
    answers = iter(["1", "", "", "", "", "3", "bf16"])  # multi-CPU, 1 machine, defaults, 3 processes, bf16
    cfg = cluster.get_cluster_input(Prompter(read=lambda prompt: next(answers), write=lambda *a: None))
    assert isinstance(cfg, config_args.ClusterConfig)
    assert (cfg.distributed_type, cfg.num_processes, cfg.mixed_precision, cfg.use_cpu) == ("MULTI_CPU", 3, "bf16", True)


def test_default_and_update_modules(tmp_path, capsys):
    target = tmp_path / "d.yaml"
    assert default.write_basic_config("fp16", str(target), device_count=0) == target
    assert default.write_basic_config("bf16", str(target), device_count=0) is None  # never overwritten
    assert load_config_from_file(str(target)).mixed_precision == "fp16"
    old = tmp_path / "old.yaml"
    old.write_text("distributed_type: 'NO'\nfp16: true\ndynamo_backend: 'NO'\n")
    assert update.update_config(argparse.Namespace(config_file=str(old))) == old
    assert "fp16:" not in old.read_text() and "mixed_precision: fp16" in old.read_text()
    with pytest.raises(ConfigurationError, match="does not exist"):
        update.update_config(argparse.Namespace(config_file=str(tmp_path / "none.yaml")))
    assert update.update_config_command(argparse.Namespace(config_file=str(tmp_path / "none.yaml"))) == 2


def test_get_config_parser_is_hasten_configs():
    parser = get_config_parser()
    assert parser.parse_args(["--config_file", "x.yaml"]).func is config.config_command
    args = parser.parse_args(["update", "--config_file", "x.yaml"])
    assert args.func is update.update_config_command and args.config_file == "x.yaml"
    assert parser.parse_args(["default"]).func is default.default_config_command
    sub = argparse.ArgumentParser().add_subparsers()
    assert config.config_command_parser(sub).prog.endswith(" config")
