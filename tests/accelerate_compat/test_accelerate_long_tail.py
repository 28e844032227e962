"""Drop-in behaviour behind Accelerate's long tail of names (issue 15): availability checks, refusals,
Accelerate's parameter names, module paths, state reuse, debug mode, launcher failures, the older
tensor-parallel plugin."""

from __future__ import annotations

import importlib
import inspect
import json
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from hasten.exceptions import ConfigurationError, LaunchError
from hasten.state import AcceleratorState, PartialState
from hasten.testing import run_on_ranks

ROWS = json.loads((Path(__file__).parents[1] / "fixtures" / "accelerate_inventory.json").read_text())["names"]


# ----------------------------------------------------------------------------------- is_*_available
def test_availability_checks_answer_truthfully_without_importing():
    code = ("import sys\nfrom hasten.utils import is_deepspeed_available, is_transformers_available, "
            "is_npu_available, is_pytest_available, is_xpu_available, is_bf16_available\n"
            "answers = [is_deepspeed_available(), is_transformers_available(), is_pytest_available(), "
            "is_npu_available(), is_xpu_available(), is_bf16_available()]\n"
            "print(answers, [m for m in ('deepspeed', 'transformers', 'pytest') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    import importlib.util

    expected = [importlib.util.find_spec(m) is not None for m in ("deepspeed", "transformers")]
    assert out.stdout.strip() == f"{expected + [True, False, False, True]} []"


def test_availability_checks_are_cached(monkeypatch):
    from hasten.utils import imports

    imports._installed.cache_clear()
    calls = []
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: calls.append(name) or real(name, *a))
    assert imports.is_timm_available() == imports.is_timm_available()
    assert calls == ["timm"]
    assert not imports._installed("no_such_package_for_hasten_tests")


def test_every_is_available_function_returns_a_bool():
    import hasten.utils as utils

    names = [r["name"] for r in ROWS if r["module"] == "accelerate.utils" and r["name"].startswith("is_")
             and r["name"].endswith("_available")]
    assert len(names) > 50
    for name in names:
        assert isinstance(getattr(utils, name)(), bool), name


def test_compare_versions_and_torch_version():
    from hasten.utils import compare_versions, is_torch_version

    assert is_torch_version(">=", "2.0") and not is_torch_version("<", "2.0")
    assert compare_versions("torch", ">=", "2.0") and compare_versions("1.2.3", "<", "1.10")
    with pytest.raises(ValueError, match="operation"):
        compare_versions("1.0", "~=", "1.0")


# ------------------------------------------------------------------------------------------ refusals
def _refused_callables():
    seen = set()
    for row in ROWS:
        if not row.get("refused"):
            continue
        module = importlib.import_module("hasten" + row["module"][len("accelerate"):])
        head, _, member = row["name"].partition(".")
        obj = getattr(module, head)
        if member or id(obj) in seen:
            continue
        seen.add(id(obj))
        yield row["name"], obj


@pytest.mark.parametrize("name,obj", list(_refused_callables()), ids=lambda v: v if isinstance(v, str) else "")
def test_refused_names_raise_a_configuration_error_at_use(name, obj):
    if name == "tpu_command_launcher":
        assert obj(None) == 2
        return
    if name == "Accelerator.lomo_backward":
        return  # covered below, on an instance
    params = [p for p in inspect.signature(obj.__init__ if inspect.isclass(obj) else obj).parameters
              if p != "self"]
    with pytest.raises(ConfigurationError, match=f"`{name}` belongs to .* hasten does not support"):
        obj(*([None] * len([p for p in params if p not in ("args", "kwargs")])))


def test_refused_method_of_accelerator(cpu_accelerator):
    with pytest.raises(ConfigurationError, match="LOMO"):
        cpu_accelerator.lomo_backward(torch.tensor(1.0), 0.1)


def test_megatron_scheduler_import_works_and_use_is_refused():
    from hasten.utils import MegatronLMDummyScheduler  # examples/by_feature import it unconditionally

    with pytest.raises(ConfigurationError, match="FSDP2 .* or DeepSpeed"):
        MegatronLMDummyScheduler(optimizer=None, total_num_steps=10, warmup_num_steps=1)


def test_parallelism_config_refuses_what_hasten_does_not_run():
    from hasten import ParallelismConfig
    from hasten.parallelism_config import ParallelismConfig as same_class

    assert same_class is ParallelismConfig  # accelerate.parallelism_config's path, hasten's implementation
    assert ParallelismConfig(dp_shard_size=4).total_size == 4
    assert ParallelismConfig(dp_replicate_size=2).dp_dim_names == ["dp_replicate", "dp_shard"]  # dp_shard: size 1
    assert ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, tp_size=2).total_size == 8  # HSDP + TP runs
    with pytest.raises(ConfigurationError, match="sp_size=2: DeepSpeed-Ulysses sequence parallelism"):
        ParallelismConfig(sp_size=2)


def test_pippy_device_map_helpers_work():  # prepare_pippy itself: tests/big_modeling/test_pippy.py
    from hasten.inference import find_pippy_batch_size, generate_device_map

    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    device_map = generate_device_map(model, num_processes=2)
    assert sorted(set(device_map.values())) == [0, 1] and set(device_map) == {"0", "1", "2", "3"}
    assert find_pippy_batch_size((torch.zeros(5, 2),), {}) == 5
    assert find_pippy_batch_size(None, {"x": torch.zeros(3, 2)}) == 3


# ---------------------------------------------------------------------------- Accelerate's parameters
def test_renamed_parameters_work_by_keyword():
    from hasten.tracking import GeneralTracker, register_tracker_class
    from hasten.utils import gather_object, is_torch_tensor, slice_tensors, str_to_bool

    assert gather_object(object=["a"]) == ["a"]
    assert is_torch_tensor(tensor=torch.zeros(1))
    assert str_to_bool("yes") == 1 and str_to_bool("off", to_bool=True) is False
    data = {"x": torch.arange(6)}
    assert slice_tensors(data, slice(0, 2), process_index=0, num_processes=3)["x"].tolist() == [0, 1]

    class NamedTracker(GeneralTracker):
        name = "named_for_dropin_test"
        requires_logging_directory = False

    assert register_tracker_class(tracker_class=NamedTracker) is NamedTracker


def test_trigger_sync_in_backward_is_static(cpu_accelerator):
    assert isinstance(inspect.getattr_static(type(cpu_accelerator), "trigger_sync_in_backward"), staticmethod)
    model = torch.nn.Linear(2, 2)
    with type(cpu_accelerator).trigger_sync_in_backward(model):
        model(torch.ones(1, 2)).sum().backward()
    assert model.weight.grad is not None


def test_skip_data_loader_resumes_exactly():
    from hasten.data_loader import SkipDataLoader

    def loader():
        return SkipDataLoader(list(range(24)), batch_size=4, shuffle=True,
                              generator=torch.Generator().manual_seed(3))

    full = [b.tolist() for b in loader()]
    first = loader()
    iterator = iter(first)
    seen = [next(iterator).tolist(), next(iterator).tolist()]
    state = first.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    rest = [b.tolist() for b in resumed]
    assert seen + rest == full
    resumed.adjust_state_dict_for_prefetch()  # nothing to adjust; exists like Accelerate's


# ---------------------------------------------------------------------------------------- module paths
def test_accelerate_internal_module_paths():
    from hasten.accelerator import DistributedType, GeneralTracker, PartialState as FromAccelerator, gather
    from hasten.commands.config import config_command_parser, default_command_parser
    from hasten.commands.launch import launch_command_parser
    from hasten.commands.merge import merge_command, merge_command_parser
    from hasten.utils.operations import DistributedOperationException, copy_tensor_to_devices, reduce

    assert FromAccelerator is PartialState and DistributedType.NO == "NO" and callable(gather)
    assert issubclass(DistributedOperationException, RuntimeError) and callable(reduce)
    assert GeneralTracker.__name__ == "GeneralTracker" and callable(copy_tensor_to_devices)
    assert launch_command_parser().prog == "hasten launch"
    args = config_command_parser().parse_args(["default", "--mixed_precision", "bf16"])
    assert args.mixed_precision == "bf16" and callable(default_command_parser)
    merge = merge_command_parser().parse_args(["ckpt", "out"])
    assert merge.func is not None and callable(merge_command)


def test_tpu_config_command_refuses_with_exit_2():
    from hasten.commands.main import main

    assert main(["tpu-config", "--tpu_name", "pod", "--command", "echo", "hi"]) == 2


def test_test_utils_regression_helpers_train():
    from hasten.test_utils import RegressionDataset, RegressionModel, assert_exception, capture_call_output
    from hasten.test_utils.training import mocked_dataloaders

    data = RegressionDataset(a=2, b=3, length=64, seed=0)
    model = RegressionModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(30):
        for batch in DataLoader(data, batch_size=16):
            loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    assert abs(model.a.item() - 2) < 0.1 and abs(model.b.item() - 3) < 0.1
    with assert_exception(ValueError, "bad"):
        raise ValueError("bad value")
    assert capture_call_output(print, "hello") == "hello\n"
    train, evaluation = mocked_dataloaders(None, batch_size=8)
    batch = next(iter(train))
    assert batch["input_ids"].shape == (8, 32) and len(evaluation) == 4


# ------------------------------------------------------------------------------------------ state reuse
@pytest.fixture
def cpu_accelerator():
    from hasten import Accelerator

    return Accelerator(cpu=True)


def test_second_accelerator_reuses_state_and_explicit_change_raises():
    from hasten import Accelerator

    first = Accelerator(cpu=True, mixed_precision="bf16")
    second = Accelerator(cpu=True)
    assert second.mixed_precision == "bf16" and second.state.__dict__ is first.state.__dict__
    with pytest.raises(ValueError, match="mixed_precision='bf16'.*'fp16'"):
        Accelerator(cpu=True, mixed_precision="fp16")


def test_unpickled_accelerator_shares_process_state(cpu_accelerator):
    copy = pickle.loads(pickle.dumps(cpu_accelerator))
    assert copy.state.__dict__ is AcceleratorState._shared_state
    assert copy.state.device == cpu_accelerator.state.device


def test_accelerator_state_has_process_members(cpu_accelerator):
    state = AcceleratorState()
    assert state.is_main_process and state.is_local_main_process and state.is_last_process
    assert not state.use_distributed and not state.fork_launched
    with state.split_between_processes([1, 2, 3]) as part:
        assert part == [1, 2, 3]
    with state.main_process_first():
        pass


@pytest.mark.world_size(2)
def test_destroy_process_group_after_reset():
    import torch.distributed as dist

    from hasten import Accelerator

    state = Accelerator(cpu=True).state
    AcceleratorState._reset_state(reset_partial_state=True)
    state.destroy_process_group()  # Accelerate's tests call it on the old object after a reset
    assert not dist.is_initialized()
    PartialState().destroy_process_group()  # and again on a fresh one: nothing left, no error


@pytest.mark.world_size(2)
def test_setting_state_debug_turns_on_the_checks():
    from hasten import Accelerator
    from hasten.utils.operations import DistributedOperationException, gather

    accelerator = Accelerator(cpu=True)
    assert not accelerator.state.debug
    accelerator.state.debug = True
    assert PartialState().debug
    tensor = torch.zeros(2, 3) if accelerator.process_index == 0 else torch.zeros(4)
    with pytest.raises(DistributedOperationException, match="ranks disagree"):
        gather(tensor)
    accelerator.state.debug = False
    assert gather(torch.ones(1)).tolist() == [1.0, 1.0]


# -------------------------------------------------------------------------------------------- launchers
def _fails():
    raise RuntimeError("boom in a rank")


def test_debug_launcher_failure_is_a_child_failed_error():
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from hasten.launchers import debug_launcher

    with pytest.raises(ChildFailedError) as info:
        debug_launcher(_fails, num_processes=2)
    assert isinstance(info.value, LaunchError) and "boom in a rank" in str(info.value)


# ------------------------------------------------------------------------------------ join_uneven_inputs
def test_join_uneven_inputs_warns_for_non_joinable_models():
    from hasten.accelerator import Accelerator

    class FakeDistributed(Accelerator):
        use_distributed = True  # type: ignore[assignment]

    accelerator = FakeDistributed(cpu=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with accelerator.join_uneven_inputs([torch.nn.Linear(2, 2)]):
            pass
    assert any("only supported for multi-GPU training" in str(w.message) for w in caught)  # Accelerate's wording


# -------------------------------------------------------------------------------------------------- fp8
def test_fp8_is_refused_on_this_machine_naming_the_hardware_requirement():
    from hasten import Accelerator
    from hasten.utils import AORecipeKwargs

    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        pytest.skip("this machine has fp8 hardware")
    with pytest.raises(ConfigurationError, match="compute capability 8.9 or newer.*torchao.*bf16"):
        Accelerator(cpu=True, mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs()])


def test_fp8_recipe_kwargs_exist_and_validate():
    from hasten import Accelerator
    from hasten.utils import AORecipeKwargs, FP8RecipeKwargs, MSAMPRecipeKwargs, TERecipeKwargs

    assert FP8RecipeKwargs(backend="te", amax_history_len=16).backend == "TE"
    assert TERecipeKwargs(fp8_format="e4m3").fp8_format == "E4M3"
    with pytest.raises(ConfigurationError, match="fp8_format"):
        TERecipeKwargs(fp8_format="E3M4")
    with pytest.raises(ConfigurationError, match="opt_level"):
        MSAMPRecipeKwargs(opt_level="O3")
    handler = AORecipeKwargs(pad_inner_dim=True)
    accelerator = Accelerator(cpu=True, kwargs_handlers=[handler])
    assert accelerator.ao_recipe_handler is handler and accelerator.fp8_backend == "NO"


def test_fp8_filter_skips_layers_float8_cannot_multiply():
    from hasten.utils import filter_first_and_last_linear_layers

    assert filter_first_and_last_linear_layers(torch.nn.Linear(32, 64), "layers.1")
    assert not filter_first_and_last_linear_layers(torch.nn.Linear(30, 64), "layers.1")
    assert not filter_first_and_last_linear_layers(torch.nn.ReLU(), "act")


@pytest.mark.launch
def test_notebook_launcher_failure_is_a_child_failed_error(tmp_path):
    import os
    import textwrap

    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent("""
        def train():
            raise ValueError("rank failed on purpose")

        if __name__ == "__main__":
            from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
            from hasten.exceptions import LaunchError
            from hasten.launchers import notebook_launcher
            try:
                notebook_launcher(train, num_processes=2)
            except ChildFailedError as exc:
                print("CAUGHT", isinstance(exc, LaunchError), "rank failed on purpose" in str(exc))
    """))
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", TMPDIR=str(tmp_path),
               HASTEN_HOME=str(tmp_path / "home"), PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert "CAUGHT True True" in proc.stdout, proc.stdout + proc.stderr


# ------------------------------------------------------------------------------------------ small helpers
def test_model_and_dict_helpers():
    from hasten.utils import (
        clean_state_dict_for_safetensors,
        compile_regions,
        convert_bytes,
        extract_model_from_parallel,
        get_module_children_bottom_up,
        get_pretty_name,
        has_compiled_regions,
        merge_dicts,
        recursive_getattr,
    )

    assert merge_dicts({"a": {"b": 1}, "c": 2}, {"a": {"d": 3}}) == {"a": {"d": 3, "b": 1}, "c": 2}
    assert convert_bytes(3 * 2**30) == "3.0 GB" and convert_bytes(512) == "512 bytes"
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ModuleList([torch.nn.Linear(2, 2)] * 1 +
                                                                          [torch.nn.Linear(2, 2)]))
    assert recursive_getattr(model, "1.0.weight") is model[1][0].weight
    assert get_pretty_name(torch.nn.Linear) == "Linear"
    assert get_module_children_bottom_up(model)[-1] is model
    tied = {"a": model[0].weight, "b": model[0].weight, "c": model[1][0].weight}
    assert list(clean_state_dict_for_safetensors(tied)) == ["a", "c"]
    compiled = compile_regions(model)
    assert has_compiled_regions(compiled) and not has_compiled_regions(model)
    assert isinstance(compiled[1][0], torch._dynamo.eval_frame.OptimizedModule)
    assert extract_model_from_parallel(torch.compile(model), keep_torch_compile=False) is model


def test_custom_state_and_save_load_round_trip(tmp_path, cpu_accelerator):
    from hasten.utils import load, load_custom_state, save, save_custom_state

    source, target = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    save_custom_state(source, tmp_path, index=1)
    assert (tmp_path / "custom_checkpoint_1.pkl").is_file()
    load_custom_state(target, tmp_path, index=1)
    assert torch.equal(source.weight, target.weight)
    save(source.state_dict(), tmp_path / "w.safetensors", safe_serialization=True)
    assert torch.equal(load(tmp_path / "w.safetensors")["weight"], source.weight.detach())
    save({"step": 3}, tmp_path / "s.pt")
    assert load(tmp_path / "s.pt") == {"step": 3}


def test_environment_helpers(monkeypatch):
    import os

    from hasten.utils import clear_environment, convert_dict_to_env_variables, get_current_device_type

    monkeypatch.setenv("HASTEN_DROPIN_TEST", "1")
    with clear_environment():
        assert "HASTEN_DROPIN_TEST" not in os.environ
    assert os.environ["HASTEN_DROPIN_TEST"] == "1"
    with pytest.warns(UserWarning, match="BAD"):
        lines = convert_dict_to_env_variables({"A": "1", "BAD": "x y"})
    assert lines == ["A=1\n"]
    assert get_current_device_type() == (("cuda", "nccl") if torch.cuda.is_available() else ("cpu", "gloo"))


# ------------------------------------------------------------------ older tensor-parallel plugin
def _tp_plugin_run():
    from hasten import Accelerator
    from hasten.utils import TorchTensorParallelPlugin

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator = Accelerator(cpu=True, torch_tp_plugin=TorchTensorParallelPlugin(tp_size=2))
    deprecated = any(issubclass(w.category, FutureWarning) and "ParallelismConfig" in str(w.message) for w in caught)
    return accelerator.parallelism_config.tp_size, accelerator.state.device_mesh["tp"].size(), deprecated


def test_torch_tensor_parallel_plugin_runs_as_parallelism_config_tp_size():
    """Accelerate 1.15 maps ``torch_tp_plugin`` onto ``ParallelismConfig(tp_size=...)`` with a FutureWarning."""
    assert run_on_ranks(_tp_plugin_run, world_size=2) == [(2, 2, True), (2, 2, True)]
