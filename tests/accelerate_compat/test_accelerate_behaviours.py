"""Behaviours that code written for Accelerate 1.15 relies on (issue 27), one test each; the docstring of
each test states Accelerate's behaviour, checked against Accelerate 1.15 on the same inputs."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from hasten import Accelerator, skip_first_batches
from hasten.state import AcceleratorState


@pytest.fixture(autouse=True)
def _fresh_state():
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def test_skip_first_batches_then_prepare_keeps_the_skip():
    """Accelerate: ``prepare(skip_first_batches(loader, 2))`` yields the batches after the first two, and its
    ``len()`` leaves them out."""
    accelerator = Accelerator(cpu=True)
    prepared = accelerator.prepare(skip_first_batches(DataLoader(list(range(16)), batch_size=4), 2))
    assert len(prepared) == 2
    assert [b.tolist() for b in prepared] == [[8, 9, 10, 11], [12, 13, 14, 15]]


def test_skip_first_batches_on_a_prepared_loader_keeps_its_epoch():
    """Accelerate: skipping on a prepared loader keeps the epoch given to ``set_epoch``."""
    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(DataLoader(list(range(16)), batch_size=4, shuffle=True))
    loader.set_epoch(1)
    assert accelerator.skip_first_batches(loader, 1).iteration == 1


def test_register_save_state_pre_hook_returns_a_working_handle(tmp_path):
    """Accelerate: the hook runs on ``save_state`` and the returned ``RemovableHandle`` removes it. (hasten
    hands the hook the folder it is writing, published as ``a`` once complete.)"""
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(nn.Linear(2, 2))
    calls = []
    handle = accelerator.register_save_state_pre_hook(lambda models, weights, out: calls.append(out))
    accelerator.save_state(tmp_path / "a")
    handle.remove()
    accelerator.save_state(tmp_path / "b")
    assert len(calls) == 1 and calls[0].startswith(str(tmp_path / "a")) and (tmp_path / "a").is_dir()
    assert model is not None


@pytest.mark.world_size(2, env={"PARALLELISM_CONFIG_DP_SHARD_SIZE": "2"})
def test_parallelism_config_reads_accelerates_environment_variables():
    """Accelerate: sizes not passed come from ``PARALLELISM_CONFIG_*`` (what ``accelerate launch`` sets), so
    ``ParallelismConfig()`` on 2 processes runs sharded over both (not DDP, the rule for all-1 sizes).
    hasten reads them when the run resolves its layout, into ``accelerator.parallelism_config``; the
    user's own object keeps what it was given (docs/migrating.md, "Differs on purpose")."""
    from hasten.config.parallelism import resolve_parallelism_config
    from hasten.parallelism_config import ParallelismConfig

    mine = ParallelismConfig()
    accelerator = Accelerator(cpu=True, parallelism_config=mine)
    run = accelerator.parallelism_config
    assert (run.dp_replicate_size, run.dp_shard_size, run.tp_size) == (1, 2, 1)
    assert accelerator.is_fsdp2 and accelerator.torch_device_mesh["dp_shard"].size() == 2
    # what the config channel resolves from the environment is what the run uses, everywhere
    assert run == resolve_parallelism_config(ParallelismConfig(), num_processes=2)
    assert AcceleratorState().parallelism_config is run and run.device_mesh is accelerator.torch_device_mesh
    assert (mine.dp_shard_size, mine.device_mesh) == (1, None)
    explicit = resolve_parallelism_config(ParallelismConfig(dp_replicate_size=2, dp_shard_size=1), num_processes=2)
    assert (explicit.dp_replicate_size, explicit.dp_shard_size) == (2, 1)  # an explicit value wins
    accelerator.end_training()


def test_launch_parser_namespace_holds_every_option():
    """Accelerate: ``launch_command_parser().parse_args`` sets every option, None when not given."""
    from hasten.commands.launch import launch_command_parser

    args = launch_command_parser().parse_args(["train.py"])
    assert (args.debug, args.num_processes, args.mixed_precision, args.multi_gpu, args.cpu) == (None,) * 5
    args = launch_command_parser().parse_args(["--debug", "--num_processes", "2", "--mixed_precision", "bf16",
                                               "train.py"])
    assert (args.debug, args.num_processes, args.mixed_precision) == (True, 2, "bf16")


def test_unwrap_model_removes_data_parallel_inside_torch_compile():
    """Accelerate: ``unwrap_model(torch.compile(DataParallel(m)))`` is the compiled wrapper around ``m``."""
    inner = nn.Linear(2, 2)
    unwrapped = Accelerator(cpu=True).unwrap_model(torch.compile(nn.DataParallel(inner)))
    assert isinstance(unwrapped, torch._dynamo.eval_frame.OptimizedModule) and unwrapped._orig_mod is inner
    assert Accelerator(cpu=True).unwrap_model(torch.compile(nn.DataParallel(inner)), keep_torch_compile=False) is inner


def test_dynamo_plugin_and_torch_device_read_accelerates_variables(monkeypatch):
    """Accelerate: ``TorchDynamoPlugin()`` takes unset settings from ``ACCELERATE_DYNAMO_*``;
    ``ACCELERATE_TORCH_DEVICE=cpu:64`` is the state's device, index included."""
    from hasten.utils import TorchDynamoPlugin

    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "inductor")
    monkeypatch.setenv("ACCELERATE_DYNAMO_MODE", "max-autotune")
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_FULLGRAPH", "true")
    plugin = TorchDynamoPlugin()
    assert (str(plugin.backend), plugin.mode, plugin.fullgraph) == ("INDUCTOR", "max-autotune", True)
    assert str(TorchDynamoPlugin(backend="eager").backend) == "EAGER"
    code = "from hasten import PartialState; print(PartialState().device)"
    env = dict(os.environ, ACCELERATE_TORCH_DEVICE="cpu:64")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "cpu:64"


def test_purge_accelerate_environment_covers_subclasses_and_stacked_decorators():
    """Accelerate: decorating a class cleans up after its tests, its subclasses' own tests (pytest-style
    classes too), and a second decoration does not wrap twice."""
    from hasten.utils import purge_accelerate_environment

    @purge_accelerate_environment
    @purge_accelerate_environment
    class Base:
        def test_a(self):
            os.environ["ACCELERATE_BEHAVIOUR_A"] = "1"

    class Sub(Base):
        def test_b(self):
            os.environ["ACCELERATE_BEHAVIOUR_B"] = "1"

    Sub().test_a()
    Sub().test_b()
    assert "ACCELERATE_BEHAVIOUR_A" not in os.environ and "ACCELERATE_BEHAVIOUR_B" not in os.environ
    assert not hasattr(Base.test_a.__wrapped__, "__wrapped__")  # wrapped once


def test_convert_dict_to_env_variables_drops_unsafe_values_with_a_warning():
    """Accelerate: entries whose value holds spaces or ``;`` are left out, each with a warning."""
    from hasten.utils import convert_dict_to_env_variables

    with pytest.warns(UserWarning) as caught:
        lines = convert_dict_to_env_variables({"A": "1", "B": "x; rm -rf /", "C": "a b"})
    assert lines == ["A=1\n"] and len(caught) == 2


def test_pad_across_processes_leaves_nested_tensors_with_a_warning():
    """Accelerate: a nested tensor is returned unpadded, with ``CannotPadNestedTensorWarning``."""
    from hasten.utils import CannotPadNestedTensorWarning, pad_across_processes

    Accelerator(cpu=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's "nested tensors are a prototype"
        nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    with pytest.warns(CannotPadNestedTensorWarning):
        assert pad_across_processes(nested) is nested


def test_save_with_shared_tensors_and_concatenate_of_objects_raise_as_in_accelerate(tmp_path):
    """Accelerate 1.15: ``save(..., safe_serialization=True)`` of tensors sharing memory raises safetensors'
    error; ``concatenate`` of non-tensors raises ``TypeError``."""
    from hasten.utils import concatenate, save

    shared = torch.zeros(4)
    with pytest.raises(RuntimeError, match="share memory"):
        save({"a": shared, "b": shared}, tmp_path / "m.safetensors", safe_serialization=True)
    with pytest.raises(TypeError, match="Can only concatenate tensors"):
        concatenate(["a", "b"])


def test_save_model_of_a_disk_offloaded_model_writes_its_weights(tmp_path):
    """Accelerate: ``save_model`` of a model dispatched with disk offload writes the real weights."""
    from safetensors.torch import load_file

    from hasten import disk_offload

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    disk_offload(model, tmp_path / "offload", execution_device="cpu")
    assert model[0].weight.device.type == "meta"
    Accelerator(cpu=True).save_model(model, tmp_path / "out")
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert saved.keys() == reference.keys() and all(torch.equal(saved[k], reference[k]) for k in reference)


def test_check_os_kernel_logs_instead_of_warning(monkeypatch, caplog):
    """Accelerate: an old Linux kernel is reported by a log record (a warning filter does not see it)."""
    import platform

    from hasten.utils import check_os_kernel

    monkeypatch.setattr(platform, "uname", lambda: type("U", (), {"system": "Linux", "release": "4.4.0"})())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with caplog.at_level(logging.WARNING):
            check_os_kernel()
    assert "Detected kernel version 4.4.0" in caplog.text


def test_prepare_after_reset_state_raises_attribute_error():
    """Accelerate: after ``AcceleratorState._reset_state()``, ``prepare`` raises an AttributeError naming
    ``_reset_state`` (its test_script.py checks the message)."""
    accelerator = Accelerator(cpu=True)
    AcceleratorState._reset_state()
    with pytest.raises(AttributeError, match=r"This happens if `AcceleratorState._reset_state\(\)`"):
        accelerator.prepare(nn.Linear(1, 1))


def test_skip_data_loader_has_base_dataloader_and_registers_with_gradient_state():
    """Accelerate: ``SkipDataLoader.base_dataloader`` is the loader producing the batches, and iterating a
    ``SkipDataLoader`` makes it the active loader of ``GradientState``."""
    from hasten.data_loader import SkipDataLoader

    accelerator = Accelerator(cpu=True)
    loader = SkipDataLoader(list(range(8)), skip_batches=1, batch_size=2)
    assert len(loader.base_dataloader) == 4
    seen = [accelerator.gradient_state.active_dataloader is loader for _ in loader]
    assert seen == [True, True, True] and accelerator.gradient_state.active_dataloader is None


def test_an_overflow_flag_set_on_the_optimizer_stops_the_scheduler():
    """Accelerate: a prepared scheduler does not step when ``optimizer._is_overflow`` (its skipped-step
    flag) is set, as after an fp16 overflow."""
    accelerator = Accelerator(cpu=True)
    model = nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    optimizer.step()
    optimizer._is_overflow = True
    scheduler.step()
    assert optimizer.step_was_skipped and optimizer.optimizer.param_groups[0]["lr"] == 0.1
    optimizer._is_overflow = False
    scheduler.step()
    assert optimizer.optimizer.param_groups[0]["lr"] == 0.05


def test_prepare_marks_what_it_returns_and_loaders_show_their_base_dataloader():
    """Accelerate: ``prepare()`` sets ``_is_accelerate_prepared`` on the model, optimizer, scheduler and loader
    it returns (other tools test it to avoid wrapping twice, and ``prepare`` again returns them unchanged);
    every prepared loader has ``base_dataloader`` (the loader producing its batches), and
    ``SeedableRandomSampler.epoch`` counts the passes (issue 35)."""
    from hasten.data_loader import DataLoaderDispatcher, DataLoaderShard, SeedableRandomSampler
    from hasten.utils import DataLoaderConfiguration

    accelerator = Accelerator(cpu=True)
    model = nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
    prepared = accelerator.prepare(model, optimizer, scheduler, DataLoader(list(range(8)), batch_size=2))
    assert [getattr(obj, "_is_accelerate_prepared", False) for obj in prepared] == [True] * 4
    assert accelerator.prepare(*prepared[1:]) == tuple(prepared[1:])  # the same objects, not wrapped again
    loader = prepared[3]
    assert isinstance(loader, DataLoaderShard) and loader.base_dataloader is loader and len(loader.base_dataloader) == 4
    dispatcher = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=True)).prepare(
        DataLoader(list(range(8)), batch_size=2))
    assert isinstance(dispatcher, DataLoaderDispatcher) and dispatcher.base_dataloader is dispatcher
    sampler = SeedableRandomSampler(list(range(4)), data_seed=3)
    assert sampler.epoch == 0 and sorted(sampler) == [0, 1, 2, 3] and sampler.epoch == 1


def test_parallelism_config_mesh_helpers_return_accelerates_values():
    """Accelerate: ``_get_mesh()`` is ``(names, sizes)`` of the dimensions larger than 1 (``()`` for none),
    ``_set_size`` sets one size, ``_validate_accelerator`` accepts sizes of 1 on one process and refuses a
    product other than the number of processes, in its own words (issue 35)."""
    from hasten.parallelism_config import ParallelismConfig

    assert ParallelismConfig(dp_shard_size=2, tp_size=2)._get_mesh() == (("dp_shard", "tp"), (2, 2))
    assert ParallelismConfig()._get_mesh() == ()
    assert ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)._get_mesh() == (("dp_replicate", "dp_shard"),
                                                                                   (2, 2))
    config = ParallelismConfig()
    config._set_size("tp", 2)
    assert config.tp_size == 2 and config._get_mesh() == (("tp",), (2,))
    with pytest.raises(ValueError, match="Parallelism must be one of"):
        config._set_size("ep", 2)  # pp is a dimension of hasten's (pipeline parallelism); ep is nobody's
    accelerator = Accelerator(cpu=True)
    config = ParallelismConfig()
    config._validate_accelerator(accelerator)
    assert (config.dp_replicate_size, config.total_size) == (1, 1)
    with pytest.raises(ValueError, match=r"^ParallelismConfig total_size \(2\) does not match num_processes \(1\)\."):
        ParallelismConfig(dp_shard_size=2)._validate_accelerator(accelerator)


def test_error_messages_that_accelerates_tests_match_start_with_its_wording(tmp_path):
    """Accelerate's own tests match these messages (test_dataclasses, test_tracking, fsdp/test_fsdp,
    test_state_checkpointing, test_data_loader): hasten's start with the same words, its hint follows."""
    from torch.utils.data import BatchSampler

    from hasten.data_loader import BatchSamplerShard
    from hasten.parallelism_config import TorchContextParallelConfig
    from hasten.utils import FullyShardedDataParallelPlugin

    with pytest.raises(ValueError, match="Invalid cp_comm_strategy: invalid"):
        TorchContextParallelConfig(cp_comm_strategy="invalid")
    with pytest.raises(ValueError, match="Logging with `tensorboard` requires a `logging_dir`"):
        Accelerator(cpu=True, log_with="tensorboard")
    AcceleratorState._reset_state(True)
    with pytest.raises(ValueError, match="round multiple"):
        BatchSamplerShard(BatchSampler(range(20), batch_size=3, drop_last=False), 2, 0, split_batches=True)
    with pytest.raises(ValueError, match="split_batches"):
        BatchSamplerShard([[0, 1, 2, 3], [4, 5, 6, 7]], 2, 0, split_batches=True, even_batches=True)
    plugin = FullyShardedDataParallelPlugin(auto_wrap_policy="TRANSFORMER_BASED_WRAP",
                                            transformer_cls_names_to_wrap="T5Layer")
    with pytest.raises(ValueError) as caught:
        plugin.set_auto_wrap_policy(nn.Sequential(nn.Linear(2, 2)))
    assert "Could not find the transformer layer class T5Layer in the model." in str(caught.value)
    accelerator = Accelerator(cpu=True)
    model = nn.Linear(2, 2)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    accelerator.save_state(str(tmp_path / "ckpt"))
    with pytest.raises(TypeError, match="Unsupported optimizer map location passed"):
        accelerator.load_state(str(tmp_path / "ckpt"), map_location="invalid")
