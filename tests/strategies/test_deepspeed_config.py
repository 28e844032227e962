"""DeepSpeedPlugin, the deepspeed_config launch block, and DeepSpeed's bad inputs (clear errors)."""

from __future__ import annotations

import base64
import json
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator
from hasten.config.plugins.deepspeed import DeepSpeedPlugin, deepspeed_plugin_from_launch_config
from hasten.exceptions import ConfigurationError, MissingDependencyError
from hasten.state import reset_state
from hasten.utils.deepspeed import DummyOptim, DummyScheduler, HfDeepSpeedConfig


def test_defaults_are_accelerates():
    plugin = DeepSpeedPlugin()
    assert plugin.zero_stage == 2 and plugin.offload_optimizer_device == "none" and plugin.offload_param_device == "none"
    assert plugin.gradient_accumulation_steps == "auto" and plugin.gradient_clipping == "auto"
    assert plugin.zero3_init_flag is False and plugin.zero3_save_16bit_model is False and plugin.is_train_batch_min
    assert plugin.deepspeed_config["zero_optimization"]["stage"] == 2
    assert plugin.is_auto("train_micro_batch_size_per_gpu") and plugin.is_auto("train_batch_size")
    assert DeepSpeedPlugin(zero_stage=3).zero3_init_flag is True


def test_mixed_precision_blocks():
    plugin = DeepSpeedPlugin()
    plugin.set_mixed_precision("fp16")
    assert plugin.deepspeed_config["fp16"] == {"enabled": True, "auto_cast": True}
    assert plugin.deepspeed_config["bf16"] == {"enabled": False}
    auto = DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 1}, "bf16": {"enabled": "auto"}})
    auto.set_mixed_precision("bf16")
    assert auto.deepspeed_config["bf16"]["enabled"] is True and auto.engine_mixed_precision() == "bf16"
    with pytest.raises(ConfigurationError, match="enables bf16"):
        DeepSpeedPlugin(hf_ds_config={"zero_optimization": {}, "bf16": {"enabled": True}}).set_mixed_precision("fp16")


def test_config_sources(tmp_path):
    config = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 2}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    encoded = base64.urlsafe_b64encode(json.dumps(config).encode()).decode()
    for source in (config, str(path), path, encoded, HfDeepSpeedConfig(config)):
        plugin = DeepSpeedPlugin(hf_ds_config=source)
        assert plugin.zero_stage == 3 and plugin.get_value("train_micro_batch_size_per_gpu") == 2
        assert plugin.deepspeed_config["gradient_accumulation_steps"] == 1  # Accelerate's default when absent
    assert "gradient_accumulation_steps" not in config  # the caller's dict is copied, not changed


def test_fields_fill_auto_values_of_a_given_config():
    config = {"zero_optimization": {"stage": "auto", "offload_optimizer": {"device": "auto"}},
              "gradient_accumulation_steps": "auto"}
    plugin = DeepSpeedPlugin(hf_ds_config=config, zero_stage=3, offload_optimizer_device="cpu",
                             gradient_accumulation_steps=4)
    assert plugin.get_value("zero_optimization.stage") == 3
    assert plugin.get_value("zero_optimization.offload_optimizer.device") == "cpu"
    assert plugin.get_value("gradient_accumulation_steps") == 4


def test_launch_block_keys():
    plugin = deepspeed_plugin_from_launch_config({"distributed_type": "DEEPSPEED", "deepspeed_config": {
        "zero_stage": "3", "offload_optimizer_device": "cpu", "gradient_accumulation_steps": "2",
        "gradient_clipping": "0.5", "zero3_init_flag": "false", "zero3_save_16bit_model": "true",
        "deepspeed_multinode_launcher": "standard"}})
    assert plugin.zero_stage == 3 and plugin.offload_optimizer_device == "cpu"
    assert plugin.gradient_accumulation_steps == 2 and plugin.gradient_clipping == 0.5
    assert plugin.zero3_init_flag is False and plugin.zero3_save_16bit_model is True
    assert plugin.deepspeed_config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    assert deepspeed_plugin_from_launch_config({"distributed_type": "DEEPSPEED"}).zero_stage == 2


# ------------------------------------------------------------------------------------ bad input
def test_missing_config_file(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigurationError, match=r"nope\.json.*does not exist"):
        DeepSpeedPlugin(hf_ds_config=str(missing))
    with pytest.raises(ConfigurationError, match="does not exist"):
        deepspeed_plugin_from_launch_config({"deepspeed_config": {"deepspeed_config_file": str(missing)}})


def test_invalid_json(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"zero_optimization": {"stage": 2},\n}')
    with pytest.raises(ConfigurationError, match=r"bad\.json is not valid JSON: .* line 2 column 1"):
        DeepSpeedPlugin(hf_ds_config=str(path))
    path.write_text("[1, 2]")
    with pytest.raises(ConfigurationError, match="JSON object"):
        DeepSpeedPlugin(hf_ds_config=str(path))
    with pytest.raises(ConfigurationError, match="zero_optimization"):
        DeepSpeedPlugin(hf_ds_config={"train_batch_size": 8})


@pytest.mark.parametrize("stage", [4, -1, "two", True])
def test_zero_stage_out_of_range(stage):
    with pytest.raises(ConfigurationError, match="ZeRO stage must be 0, 1, 2 or 3"):
        DeepSpeedPlugin(zero_stage=stage)


def test_zero_stage_out_of_range_in_config_and_launch_block():
    with pytest.raises(ConfigurationError, match=r"zero_optimization.stage=5 is out of range"):
        DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 5}})
    with pytest.raises(ConfigurationError, match="ZeRO stage must be"):
        deepspeed_plugin_from_launch_config({"deepspeed_config": {"zero_stage": "7"}})


def test_other_bad_values():
    with pytest.raises(ConfigurationError, match="offload_optimizer_device='gpu'"):
        DeepSpeedPlugin(offload_optimizer_device="gpu")
    with pytest.raises(ConfigurationError, match="nvme_path"):
        DeepSpeedPlugin(zero_stage=3, offload_param_device="nvme")
    with pytest.raises(ConfigurationError, match="needs ZeRO stage 3"):
        DeepSpeedPlugin(zero_stage=2, offload_param_device="cpu")
    with pytest.raises(ConfigurationError, match=r"zero_optimization.stage=3 vs hasten 2"):
        DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 3}}, zero_stage=2)
    with pytest.raises(ConfigurationError, match="Unknown keys"):
        deepspeed_plugin_from_launch_config({"deepspeed_config": {"zero_stages": 2}})
    with pytest.raises(ConfigurationError, match="gradient_accumulation_steps"):
        DeepSpeedPlugin(gradient_accumulation_steps=0)


def test_missing_package_names_the_install_command(monkeypatch):
    from hasten.strategies.deepspeed import import_deepspeed

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # makes `import deepspeed` fail
    with pytest.raises(MissingDependencyError, match=r"pip install 'hasten\[deepspeed\]'"):
        import_deepspeed("cpu")


def test_dummy_optim_alone_refuses_to_step():
    model = nn.Linear(2, 2)
    optimizer = DummyOptim(p for p in model.parameters())  # a generator is kept as a list
    assert len(optimizer.params) == 2
    with pytest.raises(ConfigurationError, match="DummyOptim only stands for"):
        optimizer.step()
    with pytest.raises(ConfigurationError, match="not prepared yet"):
        DummyScheduler(optimizer).get_last_lr()


def _loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 2)), batch_size=4)


def _bad_prepare_cases() -> None:
    from hasten.strategies.deepspeed import import_deepspeed

    import_deepspeed("cpu")

    def fresh(**kwargs):
        reset_state()
        return Accelerator(deepspeed_plugin=DeepSpeedPlugin(**kwargs))

    a, b = nn.Linear(4, 2), nn.Linear(4, 2)
    with pytest.raises(ConfigurationError, match="one model per Accelerator"):
        fresh().prepare(a, b, torch.optim.SGD(a.parameters(), lr=0.1), _loader())
    accelerator = fresh()
    accelerator.prepare(a, torch.optim.SGD(a.parameters(), lr=0.1), _loader())
    with pytest.raises(ConfigurationError, match="already holds a DeepSpeed engine.*evaluation_mode=True"):
        accelerator.prepare(b, torch.optim.SGD(b.parameters(), lr=0.1))
    with pytest.raises(ConfigurationError, match="needs the training \\(or evaluation\\) DataLoader"):
        fresh().prepare(b, torch.optim.SGD(b.parameters(), lr=0.1))
    config = {"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": 4,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    with pytest.raises(ConfigurationError, match="defines an \"optimizer\""):
        fresh(hf_ds_config=config).prepare(b, torch.optim.SGD(b.parameters(), lr=0.1))
    with pytest.raises(ConfigurationError, match="DummyOptim needs an \"optimizer\" block"):
        fresh().prepare(b, DummyOptim(b.parameters()), _loader())
    with pytest.raises(ConfigurationError, match="clip_grad_value_ is not available"):
        accelerator.clip_grad_value_(a.parameters(), 1.0)


@pytest.mark.world_size(2, timeout=240)
def test_bad_prepare_calls():
    _bad_prepare_cases()
