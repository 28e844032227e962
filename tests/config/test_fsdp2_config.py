"""FSDP2 plugin, launch-configuration block and ``hasten to-fsdp2``: pure functions, no processes."""

from __future__ import annotations

import pytest
import yaml

from hasten.commands.main import main
from hasten.config.plugins.fsdp import (
    FullyShardedDataParallelPlugin,
    convert_fsdp1_config,
    fsdp_plugin_from_launch_config,
)
from hasten.connector import resolve_settings
from hasten.exceptions import ConfigurationError


def test_defaults_are_fsdp2_defaults():
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.state_dict_type == "SHARDED_STATE_DICT" and plugin.cpu_offload is False
    assert plugin.auto_wrap_policy is None and plugin.activation_checkpointing is False
    assert FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap="A, B").auto_wrap_policy == "transformer_based_wrap"
    assert FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap="A, B").transformer_cls_names_to_wrap == ["A", "B"]
    assert FullyShardedDataParallelPlugin(min_num_params="1e6").min_num_params == 1_000_000
    # Settings FSDP2 has built in are accepted and ignored.
    FullyShardedDataParallelPlugin(use_orig_params=True, sync_module_states=True, forward_prefetch=False)


@pytest.mark.parametrize("kwargs, fix", [
    ({"fsdp_version": 1}, "to-fsdp2"),
    ({"sharding_strategy": "SHARD_GRAD_OP"}, "reshard_after_forward=False"),
    ({"sharding_strategy": 1}, "reshard_after_forward=True"),
    ({"backward_prefetch": "BACKWARD_PRE"}, "prefetches"),
    ({"forward_prefetch": True}, "reshard_after_forward=False"),
    ({"reshard_after_forward": "FULL_SHARD"}, "reshard_after_forward=True"),
    ({"state_dict_type": "LOCAL_STATE_DICT"}, "FSDP1"),
    ({"auto_wrap_policy": "by_magic"}, "transformer_based_wrap"),
    ({"cpu_offload": "sometimes"}, "true or false"),
    ({"min_num_params": "many"}, "1e8"),
])
def test_fsdp1_and_invalid_settings_are_refused_with_the_fix(kwargs, fix):
    with pytest.raises(ConfigurationError, match=fix.replace("(", r"\(")):
        FullyShardedDataParallelPlugin(**kwargs)


def test_launch_block_is_read_with_accelerates_keys():
    plugin = fsdp_plugin_from_launch_config({"distributed_type": "FSDP", "fsdp_config": {
        "fsdp_version": "2", "fsdp_reshard_after_forward": "false", "fsdp_offload_params": "true",
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_transformer_layer_cls_to_wrap": "Block,Layer",
        "fsdp_state_dict_type": "FULL_STATE_DICT", "activation_checkpointing": True,  # prefix optional
        "fsdp_cpu_ram_efficient_loading": "true"}})
    assert plugin.reshard_after_forward is False and plugin.cpu_offload is True
    assert plugin.auto_wrap_policy == "transformer_based_wrap"
    assert plugin.transformer_cls_names_to_wrap == ["Block", "Layer"]
    assert plugin.state_dict_type == "FULL_STATE_DICT" and plugin.activation_checkpointing is True
    assert plugin.cpu_ram_efficient_loading is True
    assert fsdp_plugin_from_launch_config({"distributed_type": "FSDP"}) == FullyShardedDataParallelPlugin()


def test_launch_block_refuses_fsdp1_files_and_unknown_keys():
    with pytest.raises(ConfigurationError, match="hasten to-fsdp2"):
        fsdp_plugin_from_launch_config({"fsdp_config": {"fsdp_sharding_strategy": "FULL_SHARD"}})
    with pytest.raises(ConfigurationError, match="hasten to-fsdp2"):
        fsdp_plugin_from_launch_config({"fsdp_config": {"fsdp_version": 1}})
    with pytest.raises(ConfigurationError, match="fsdp_reshard_after_forward"):
        fsdp_plugin_from_launch_config({"fsdp_config": {"fsdp_sharding_strateg": "FULL_SHARD"}})
    with pytest.warns(UserWarning, match="fsdp_sync_module_states"):
        fsdp_plugin_from_launch_config({"fsdp_config": {"fsdp_version": 2, "fsdp_sync_module_states": True}})


def test_connector_builds_the_plugin_from_the_launch_configuration():
    launch = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_reshard_after_forward": False}}
    assert resolve_settings({}, launch).fsdp_plugin.reshard_after_forward is False
    explicit = FullyShardedDataParallelPlugin(cpu_offload=True)
    assert resolve_settings({"fsdp_plugin": explicit}, launch).fsdp_plugin is explicit


def test_convert_fsdp1_block():
    block, notes = convert_fsdp1_config({"fsdp_version": 1, "fsdp_sharding_strategy": "HYBRID_SHARD_ZERO2",
                                         "fsdp_backward_prefetch": "BACKWARD_PRE", "fsdp_use_orig_params": True,
                                         "fsdp_offload_params": False, "fsdp_state_dict_type": "SHARDED_STATE_DICT"})
    assert block == {"fsdp_reshard_after_forward": False, "fsdp_offload_params": False,
                     "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_version": 2}
    assert len(notes) == 3
    fsdp_plugin_from_launch_config({"fsdp_config": block})  # the result is accepted


def test_to_fsdp2_command(tmp_path, capsys):
    source = tmp_path / "config.yaml"
    source.write_text(yaml.safe_dump({"distributed_type": "FSDP", "num_processes": 2, "fsdp_config": {
        "fsdp_sharding_strategy": "FULL_SHARD", "fsdp_sync_module_states": True, "fsdp_version": 1}}))
    target = tmp_path / "fsdp2.yaml"
    assert main(["to-fsdp2", "--config_file", str(source), "--output_file", str(target)]) == 0
    converted = yaml.safe_load(target.read_text())
    assert converted["num_processes"] == 2
    assert converted["fsdp_config"] == {"fsdp_reshard_after_forward": True, "fsdp_version": 2}
    assert main(["to-fsdp2", "--config_file", str(source)]) == 1  # neither --output_file nor --overwrite
    assert main(["to-fsdp2", "--config_file", str(source), "--output_file", str(target)]) == 1  # exists
    assert main(["to-fsdp2", "--config_file", str(source), "--overwrite"]) == 0
    assert yaml.safe_load(source.read_text())["fsdp_config"]["fsdp_version"] == 2
    assert "--overwrite" in capsys.readouterr().err


def test_validate_mixed_precision_policy_reads_dtype_names_like_the_accelerator() -> None:
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    plugin = FullyShardedDataParallelPlugin(mixed_precision_policy={"param_dtype": "bf16", "reduce_dtype": "torch.float32",
                                                                     "cast_forward_inputs": False})
    plugin.validate_mixed_precision_policy()
    assert plugin.mixed_precision_policy == MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                                 cast_forward_inputs=False)
    with pytest.raises(ConfigurationError, match="'bfloat17'.*bf16"):
        FullyShardedDataParallelPlugin(mixed_precision_policy={"param_dtype": "bfloat17"}).validate_mixed_precision_policy()
    with pytest.raises(ConfigurationError, match=r"\['param_type'\] are not MixedPrecisionPolicy fields"):
        FullyShardedDataParallelPlugin(mixed_precision_policy={"param_type": "bf16"}).validate_mixed_precision_policy()
