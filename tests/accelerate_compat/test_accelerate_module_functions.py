"""The names issue 27 added at Accelerate's module paths behave as Accelerate 1.15's do.

Expected values were computed with Accelerate 1.15 on the same inputs (noted where it matters)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 8))
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(2), persistent=False)
        self.block[0].register_buffer("tmp", torch.ones(1), persistent=False)


def test_device_map_building_blocks_give_accelerates_answers():
    from hasten.utils.modeling import (
        check_device_same,
        compute_module_sizes,
        fallback_allocate,
        find_tied_parameters,
        get_module_leaves,
        get_module_size_with_ties,
        get_non_persistent_buffers,
    )

    model = _Tied()
    sizes = compute_module_sizes(model)
    modules = list(model.named_children())
    assert sorted(get_module_leaves(sizes)) == ["block.0.bias", "block.0.tmp", "block.0.weight", "block.2.bias",
                                                 "block.2.weight", "embed.weight", "scale"]
    assert get_module_size_with_ties(["head.weight"], sizes["embed"], sizes, modules)[:2] == (160, ["head"])
    tied = find_tied_parameters(model)
    expected = {200: ("embed", ["block", "head"]), 100: ("block.0", ["block.1", "block.2", "head"]),
                60: ("block.1", ["block.0", "block.2", "head"])}
    for limit, (name, rest) in expected.items():
        found, _, remaining = fallback_allocate(modules, sizes, limit, tied_parameters=tied)
        assert (found, [n for n, _ in remaining]) == (name, rest), limit
    assert fallback_allocate(modules, sizes, "not a size") == (None, None, modules)
    assert get_non_persistent_buffers(model) == {"scale"}
    assert get_non_persistent_buffers(model, recurse=True) == {"scale", "tmp"}
    assert get_non_persistent_buffers(model, recurse=True, fqns=True) == {"scale", "block.0.tmp"}
    assert check_device_same(torch.device("cpu"), torch.device("cpu"))
    assert not check_device_same(torch.device("cpu"), torch.device("meta"))


def test_get_state_dict_from_offload_reads_an_offloaded_modules_weights():
    from hasten.hooks import AlignDevicesHook, add_hook_to_module
    from hasten.utils.modeling import get_state_dict_from_offload

    layer = nn.Linear(3, 2)
    weights = {k: v.detach().clone() for k, v in layer.state_dict().items()}
    add_hook_to_module(layer, AlignDevicesHook(execution_device="cpu", offload=True, weights_map=weights))
    assert layer.weight.device.type == "meta"
    state = get_state_dict_from_offload(layer, "lin.weight", {"lin.weight": "p", "lin.bias": "q", "other": 1})
    assert torch.equal(state["lin.weight"], weights["weight"]) and torch.equal(state["lin.bias"], weights["bias"])
    assert state["other"] == 1 and layer.weight.device.type == "meta"  # back on meta afterwards


def test_repeated_blocks_and_module_class_lookup():
    from hasten.utils.dataclasses import get_module_class_from_name
    from hasten.utils.other import has_repeated_blocks, is_repeated_blocks

    blocks = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    assert is_repeated_blocks(blocks) and not is_repeated_blocks(nn.ModuleList([nn.Linear(2, 2), nn.ReLU()]))
    assert has_repeated_blocks(nn.Sequential(nn.ReLU(), blocks)) and not has_repeated_blocks(nn.Linear(2, 2))
    assert get_module_class_from_name(nn.Sequential(nn.Sequential(nn.GELU())), "GELU") is nn.GELU
    assert get_module_class_from_name(nn.Sequential(), "GELU") is None


def test_float8_filter_has_accelerates_signature():
    from hasten.utils.ao import filter_linear_layers

    assert filter_linear_layers(nn.Linear(32, 32), "mid", ["first", "last"]) is True
    assert filter_linear_layers(nn.Linear(32, 32), "last", ["first", "last"]) is False
    assert filter_linear_layers(nn.Linear(30, 32), "mid", []) is False  # dimensions not multiples of 16


def test_convert_config_to_fsdp2_matches_accelerate():
    from hasten.commands.to_fsdp2 import ARGUMENT_KEY_MAPPING, ConversionStatus, convert_config_to_fsdp2

    config = {"fsdp_config": {"fsdp_sharding_strategy": "FULL_SHARD", "fsdp_backward_prefetch": "BACKWARD_PRE",
                              "fsdp_offload_params": False}, "num_processes": 2}
    assert convert_config_to_fsdp2(config) == {"fsdp_config": {"fsdp_reshard_after_forward": True,
                                                               "fsdp_offload_params": False, "fsdp_version": 2},
                                               "num_processes": 2}
    already = {"fsdp_config": {"fsdp_version": 2, "fsdp_sharding_strategy": "FULL_SHARD"}}
    assert convert_config_to_fsdp2(already) == {"fsdp_config": {"fsdp_version": 2,
                                                                "fsdp_sharding_strategy": "FULL_SHARD"}}
    assert convert_config_to_fsdp2({"a": 1}) == {"a": 1}
    assert ARGUMENT_KEY_MAPPING["fsdp_use_orig_params"] is ConversionStatus.REMOVED


class _Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(100, 100)
        self.b = nn.Linear(100, 10)


def test_gather_data_rows_are_accelerates():
    from hasten.commands.estimate import create_ascii_table, estimate_training_usage, gather_data

    args = argparse.Namespace(model_name=f"{__name__}:_Small", library_name=None, trust_remote_code=False,
                              dtypes=["float32", "float16", "int8", "int4"])
    total = (100 * 100 + 100 + 100 * 10 + 10) * 4
    largest = (100 * 100 + 100) * 4
    rows = gather_data(args)
    assert [r[:3] for r in rows] == [["float32", largest, total], ["float16", largest // 2, total // 2],
                                     ["int8", largest // 4, total // 4], ["int4", largest // 8, total // 8]]
    assert rows[0][3] == {"model": total, "optimizer": 2 * total, "gradients": total, "step": 4 * total}
    assert rows[1][3] == estimate_training_usage(total, "float16") == {
        "model": total, "optimizer": 2 * total, "gradients": total + total // 2, "step": 2 * total}
    assert rows[2][3] == {"model": -1, "optimizer": -1, "gradients": -1, "step": -1}
    table = create_ascii_table(["dtype", "size"], [["float32", "1 KB"]], "Memory usage")
    lines = table.splitlines()
    assert len({len(line) for line in lines}) == 1 and "Memory usage" in lines[1] and "float32" in lines[5]


class _FakeEngine:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self.calls.append(f"boundary={is_boundary}")

    def backward(self, loss: torch.Tensor) -> None:
        self.calls.append("backward")

    def step(self) -> None:
        self.calls.append("step")

    def get_global_grad_norm(self) -> torch.Tensor:
        return torch.tensor(1.5)


def test_deepspeed_wrappers_drive_the_engine_like_accelerates():
    from hasten.utils.deepspeed import (
        DeepSpeedEngineWrapper,
        DeepSpeedOptimizerWrapper,
        DeepSpeedSchedulerWrapper,
    )

    engine = _FakeEngine()
    wrapper = DeepSpeedEngineWrapper(engine)
    wrapper.backward(torch.tensor(1.0), sync_gradients=False)
    wrapper.backward(torch.tensor(1.0))
    assert engine.calls == ["boundary=False", "backward", "boundary=True", "backward", "step"]
    assert wrapper.get_global_grad_norm() == 1.5
    param = nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    wrapped = DeepSpeedOptimizerWrapper(optimizer)
    param.grad = torch.ones(1)
    wrapped.step()
    wrapped.zero_grad()
    assert param.item() == 1.0 and param.grad is not None  # the engine steps and zeroes, not the wrapper
    assert wrapped.step_was_skipped is False
    optimizer.overflow = True  # type: ignore[attr-defined]
    assert wrapped.step_was_skipped is True
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    DeepSpeedSchedulerWrapper(scheduler, [wrapped]).step()
    assert optimizer.param_groups[0]["lr"] == 1.0


def test_active_deepspeed_plugin_needs_a_deepspeed_run():
    from hasten.utils.deepspeed import get_active_deepspeed_plugin

    with pytest.raises(ValueError, match="Couldn't retrieve the active `DeepSpeedPlugin`"):
        get_active_deepspeed_plugin(argparse.Namespace(distributed_type="MULTI_CPU"))
    plugin = object()
    assert get_active_deepspeed_plugin(argparse.Namespace(distributed_type="DEEPSPEED",
                                                          deepspeed_plugin=plugin)) is plugin


def test_hf_deepspeed_config_deletes_sub_trees():
    from hasten.utils.deepspeed import HfDeepSpeedConfig

    config = HfDeepSpeedConfig({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})
    config.set_stage_and_offload()
    assert (config._stage, config._offload) == (3, True)
    config.del_config_sub_tree("zero_optimization.offload_param")
    assert config.config == {"zero_optimization": {"stage": 3}}
    config.del_config_sub_tree("not.there")
    with pytest.raises(ValueError, match="Can't find not.there"):
        config.del_config_sub_tree("not.there", must_exist=True)


def test_small_constants_and_helpers():
    from hasten.utils.environment import CPUInformation, get_cpu_distributed_information
    from hasten.utils.launch import env_var_path_add
    from hasten.utils.operations import TENSOR_INT_TO_DTYPE, TENSOR_TYPE_TO_INT

    assert TENSOR_TYPE_TO_INT[torch.bfloat16] == 4 and TENSOR_INT_TO_DTYPE[10] is torch.bool
    assert isinstance(get_cpu_distributed_information(), CPUInformation)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HASTEN_TEST_PATHS", "/a::/b")
        assert env_var_path_add("HASTEN_TEST_PATHS", "/c") == "/a:/b:/c"


def test_refused_module_names_raise_with_the_reason():
    from hasten.exceptions import ConfigurationError
    from hasten.utils import bnb, megatron_lm

    with pytest.raises(ConfigurationError, match="bitsandbytes"):
        bnb.replace_with_bnb_layers(nn.Linear(1, 1), None)
    with pytest.raises(ConfigurationError, match="Megatron-LM"):
        megatron_lm.initialize(None)


def test_memory_utils_import_warns_like_accelerates():
    sys.modules.pop("hasten.memory_utils", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import hasten.memory_utils  # noqa: F401
    assert any(issubclass(w.category, FutureWarning) and "utils.memory" in str(w.message) for w in caught)


def test_module_paths_stay_lazy():
    code = ("import sys, hasten, hasten.utils.modeling, hasten.utils.other; "
            "print('hasten._accelerate_paths' in sys.modules, 'hasten.big_modeling' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "False"]
