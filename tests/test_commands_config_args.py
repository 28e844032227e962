"""Accelerate's ``accelerate.commands.config`` names, which ``transformers env`` and ``trl env`` read."""

import pytest

from hasten.commands.config import config_args, default_config_file, load_config_from_file
from hasten.exceptions import ConfigurationError


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
