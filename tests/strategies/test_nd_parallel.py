"""N-D parallelism: ParallelismConfig checks, TP plans, HSDP == DDP, data/metrics on the mesh, resharded resume.

Ground truths: DDP on 4 ranks (HSDP must end with the same weights), a plain single-process model
(TP logits), the uninterrupted run on the first mesh (resume on another mesh). Tolerance 1e-5: the
runs differ only in how fp32 sums are split over ranks (~1e-7 relative per step), while a wrong
shard, a missed all-reduce or a lost optimizer state moves these weights by >1e-3.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import json
import os

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

from hasten import Accelerator, ParallelismConfig
from hasten.config.parallelism import parallelism_config_from_launch, resolve_parallelism_config
from hasten.exceptions import ConfigurationError
from hasten.state import reset_state
from hasten.strategies.nd import check_tp_plan, resolve_tp_plan
from hasten.testing.distributed import run_on_ranks
from hasten.utils import TorchContextParallelConfig, TorchTensorParallelConfig

ATOL = 1e-5
TP_PLAN = {"0": "colwise", "2": "rowwise"}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _config(replicate: int = 1, shard: int = 1, tp: int = 1) -> ParallelismConfig:
    handler = TorchTensorParallelConfig(tp_plan=TP_PLAN) if tp > 1 else None
    return ParallelismConfig(dp_replicate_size=replicate, dp_shard_size=shard, tp_size=tp, tp_handler=handler)


def _batch(step: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    return torch.randn(size, 6, generator=g), torch.randn(size, 3, generator=g)


def _train(accelerator: Accelerator, model: nn.Module, optimizer, steps: range) -> None:
    """Each micro-step's global batch of 8, split over the data-parallel ranks (TP ranks share theirs)."""
    dp_size, dp_rank = accelerator._data_parallel_position()
    for step in steps:
        x, y = _batch(step)
        part = len(x) // dp_size
        x, y = x[dp_rank * part:(dp_rank + 1) * part], y[dp_rank * part:(dp_rank + 1) * part]
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()


def _prepared(config: ParallelismConfig, **kwargs):
    reset_state()
    accelerator = Accelerator(cpu=True, parallelism_config=config, **kwargs)
    model = _model()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.05))
    return accelerator, model, optimizer


def _full(accelerator: Accelerator, model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in accelerator.get_state_dict(model).items()}


def _read_through_mesh(accelerator: Accelerator, samples: int) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Read ``arange(samples)`` through a prepared loader (batch 2): (this rank's samples, every rank's,
    what ``gather_for_metrics`` returned per batch)."""
    loader = accelerator.prepare(torch.utils.data.DataLoader(torch.arange(samples).float(), batch_size=2))
    seen, gathered = [], []
    for batch in loader:
        seen.append(batch)
        gathered.append(accelerator.gather_for_metrics(batch))
    mine = torch.cat(seen)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return mine, everyone, gathered


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys() and a
    return max((a[k] - b[k]).abs().max().item() for k in a)


# ----------------------------------------------------------------------------- config, no ranks
def test_sizes_default_to_one_and_name_the_mesh_as_accelerate_does():
    config = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, tp_size=2)
    assert (config.total_size, config.data_parallel_size, config.non_data_parallel_size) == (8, 4, 2)
    assert config.mesh_shape() == (("dp_replicate", "dp_shard", "tp"), (2, 2, 2))
    assert ParallelismConfig(tp_size=2).mesh_shape() == (("dp_shard", "tp"), (1, 2))  # FSDP2 needs a dp dim
    assert ParallelismConfig(cp_size=2, dp_shard_size=2).dp_shard_cp_dim_names == ["dp_shard", "cp"]
    assert isinstance(ParallelismConfig(tp_size=2).tp_handler, TorchTensorParallelConfig)
    assert "dp_shard=2 x tp=2" in ParallelismConfig(dp_shard_size=2, tp_size=2).describe()


def test_bad_sizes_and_styles_are_refused_with_the_arithmetic():
    with pytest.raises(ConfigurationError, match=r"dp_replicate_size=1 x dp_shard_size=2 x tp_size=2 x cp_size=1 = 4 "
                                                 r"processes, but the run has 3"):
        ParallelismConfig(dp_shard_size=2, tp_size=2).validate(3)
    with pytest.raises(ConfigurationError, match="tp_size=0 must be at least 1"):
        ParallelismConfig(tp_size=0)
    with pytest.raises(ConfigurationError, match="'diagonal' is not a tensor-parallel style"):
        TorchTensorParallelConfig(tp_plan={"0": "diagonal"})
    with pytest.raises(ConfigurationError, match="cp_comm_strategy"):
        TorchContextParallelConfig(cp_comm_strategy="ring")
    with pytest.raises(ConfigurationError, match="cp_size=2 needs CUDA.*flash/efficient/cuDNN"):
        ParallelismConfig(dp_shard_size=2, cp_size=2).validate(4, device_type="cpu")
    ParallelismConfig(dp_shard_size=2, cp_size=2).validate(4, device_type="cuda")  # the sizes themselves are fine


def test_accelerates_other_fields_and_launch_defaults():
    with pytest.raises(ConfigurationError, match="sp_size=2: DeepSpeed-Ulysses sequence parallelism is not available"):
        ParallelismConfig(sp_size=2)
    with pytest.raises(ConfigurationError, match="cp_backend='ring'"):
        ParallelismConfig(cp_backend="ring")
    config = ParallelismConfig(dp_shard_size=2, tp_size=2)
    assert (config.cp_backend, config.sp_backend, config.sp_size) == ("torch", "deepspeed", 1)
    assert '"tp_size": 2' in config.to_json() and config.fsdp_dim_names == ["dp_shard_cp"]


def test_a_config_never_reads_the_environment_nor_changes(monkeypatch):
    """Sizes left None read 1 whatever the launch says; no method changes the object or reads a variable."""
    monkeypatch.setenv("HASTEN_LAUNCH_CONFIG", json.dumps({"parallelism_config": {
        "parallelism_config_dp_shard_size": 2, "parallelism_config_tp_size": 2}}))
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "2")
    read: list[str] = []

    class Watched(dict):
        def __getitem__(self, key):
            read.append(key)
            return super().__getitem__(key)

        def get(self, key, default=None):
            read.append(key)
            return super().get(key, default)

        def __contains__(self, key):
            read.append(key)
            return super().__contains__(key)

        def items(self):
            read.append("<items>")
            return super().items()

    monkeypatch.setattr(os, "environ", Watched(os.environ))
    for config, sizes in ((ParallelismConfig(), (1, 1, 1, 1)), (ParallelismConfig(dp_shard_size=2, tp_size=2), (1, 2, 2, 1))):
        before = copy.deepcopy(vars(config))
        assert (config.dp_replicate_size, config.dp_shard_size, config.tp_size, config.cp_size) == sizes
        for name, member in inspect.getmembers(ParallelismConfig):
            if isinstance(member, property):
                getattr(config, name)
        config.mesh_shape(), config.describe(), config.to_json(), repr(config), config == ParallelismConfig()
        config.validate(config.total_size, device_type="cpu")
        config.validate(config.total_size, device_type=None)
        with pytest.raises(ConfigurationError, match="no mesh"):
            config.get_device_mesh()
        assert vars(config) == before
    assert read == []


def test_the_launch_fills_a_new_config_and_the_callers_values_win():
    launch = {"parallelism_config_dp_shard_size": 2, "parallelism_config_tp_size": "2",
              "parallelism_config_tp_enable_async_tp": "false"}
    env = {"PARALLELISM_CONFIG_DP_SHARD_SIZE": "4", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2"}
    mine = ParallelismConfig()
    run = resolve_parallelism_config(mine, launch_block=launch, env=env, num_processes=8)
    assert (run.dp_replicate_size, run.dp_shard_size, run.tp_size) == (2, 2, 2)  # the launch file over the variables
    assert run is not mine and (mine.dp_replicate_size, mine.dp_shard_size, mine.tp_size) == (1, 1, 1)
    assert run.tp_handler == TorchTensorParallelConfig(enable_async_tp=False)
    explicit = resolve_parallelism_config(ParallelismConfig(tp_size=4), launch_block=launch, env={}, num_processes=8)
    assert (explicit.dp_shard_size, explicit.tp_size) == (2, 4)  # explicit values win, the rest is filled in
    # nothing to fill: the same object; all 1s on several processes: DDP over all of them, in a new object
    full = ParallelismConfig(dp_replicate_size=1, dp_shard_size=2, tp_size=1, cp_size=1, sp_size=1, cp_backend="torch",
                             sp_backend="deepspeed")
    assert resolve_parallelism_config(full, launch_block={"parallelism_config_dp_shard_size": 4}, env=env,
                                      num_processes=2) is full
    ddp = resolve_parallelism_config(mine, env={}, num_processes=4)
    assert (ddp.dp_replicate_size, ddp.total_size, mine.dp_replicate_size) == (4, 4, 1)
    assert resolve_parallelism_config(None, env=env, num_processes=4) is None


def test_a_wrong_product_fails_before_any_process_group_starts():
    reset_state()
    with pytest.raises(ConfigurationError, match="= 4 processes, but the run has 1"):
        Accelerator(cpu=True, parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2))
    assert not dist.is_initialized()


def test_the_launch_configuration_block_builds_the_config():
    config = parallelism_config_from_launch({"parallelism_config": {
        "parallelism_config_dp_shard_size": "2", "parallelism_config_tp_size": 2,
        "parallelism_config_cp_comm_strategy": "alltoall"}})
    assert (config.dp_shard_size, config.tp_size, config.cp_handler.cp_comm_strategy) == (2, 2, "alltoall")
    assert parallelism_config_from_launch({}) is None
    with pytest.raises(ConfigurationError, match="Unknown parallelism_config key 'parallelism_config_ep_size'"):
        parallelism_config_from_launch({"parallelism_config": {"parallelism_config_ep_size": 2}})


def test_hasten_launch_shows_the_mesh_and_refuses_a_wrong_product_before_starting(tmp_path):
    from hasten.commands.launch import build_launch_parser, overrides_from_args, resolve_config
    from hasten.launchers.plan import LaunchOptions, build_plan

    script = tmp_path / "train.py"
    script.write_text("")
    parser = build_launch_parser(argparse.ArgumentParser())

    def plan(*flags: str):
        args = parser.parse_args(["--cpu", *flags, str(script)])
        assert overrides_from_args(args)["parallelism_config"]
        return build_plan(resolve_config(args, {}), LaunchOptions(script=str(script)), {}, device_count=0)

    described = plan("--parallelism_config_dp_shard_size", "2", "--parallelism_config_tp_size", "2").describe()
    assert "processes:     4" in described  # taken from the mesh when --num_processes is not given
    assert "device mesh:   DeviceMesh(dp_shard=2 x tp=2) over 4 processes" in described
    with pytest.raises(ConfigurationError, match="= 4 processes, but the run has 3"):
        plan("--num_processes", "3", "--parallelism_config_dp_shard_size", "2", "--parallelism_config_tp_size", "2")


def test_a_config_file_block_reaches_the_dry_run_and_the_workers(tmp_path, capsys, monkeypatch):
    """A config file's `parallelism_config:` block: the dry run prints the mesh, the workers get the sizes.

    `hasten launch --config_file ... --dry_run` prints the 3-D mesh and the process count it implies;
    the workers' runs take the sizes from the environment the launcher gives them.
    """
    from hasten.commands.main import main
    from hasten.config.env import launch_config
    from hasten.connector import resolve_settings

    script, config_file = tmp_path / "train.py", tmp_path / "config.yaml"
    script.write_text("")
    config_file.write_text("compute_environment: LOCAL_MACHINE\nuse_cpu: true\nparallelism_config:\n"
                           "  parallelism_config_dp_replicate_size: 2\n  parallelism_config_dp_shard_size: 2\n"
                           "  parallelism_config_tp_size: 2\n")
    assert main(["launch", "--config_file", str(config_file), "--dry_run", str(script)]) == 0
    printed = capsys.readouterr().out
    assert "processes:     8 " in printed
    assert "device mesh:   DeviceMesh(dp_replicate=2 x dp_shard=2 x tp=2) over 8 processes; data-parallel size 4" in printed
    (line,) = [line for line in printed.splitlines() if "HASTEN_LAUNCH_CONFIG=" in line]
    monkeypatch.setenv("HASTEN_LAUNCH_CONFIG", line.split("=", 1)[1])
    launch = launch_config()
    given = resolve_settings({}, launch).parallelism_config  # Accelerator() with no config: the launch's
    filled = resolve_parallelism_config(ParallelismConfig(), launch_block=launch.parallelism_config, num_processes=8)
    for worker in (given, filled):  # Accelerator(parallelism_config=ParallelismConfig()): filled in by the run
        assert (worker.dp_replicate_size, worker.dp_shard_size, worker.tp_size, worker.cp_size) == (2, 2, 2, 1)


def test_tp_plans_expand_patterns_and_check_divisibility():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj, self.o_proj = nn.Linear(8, 8), nn.Linear(8, 8)

    model = nn.Module()
    model.layers = nn.ModuleList([Block(), Block()])
    plan = resolve_tp_plan(model, ParallelismConfig(tp_size=2, tp_handler=TorchTensorParallelConfig(
        tp_plan={"layers.*.q_proj": "colwise", "layers.*.o_proj": "rowwise"})))
    assert plan == {"layers.0.q_proj": "colwise", "layers.1.q_proj": "colwise",
                    "layers.0.o_proj": "rowwise", "layers.1.o_proj": "rowwise"}
    with pytest.raises(ConfigurationError, match="'layers.*.k_proj' matches no module"):
        resolve_tp_plan(model, ParallelismConfig(tp_size=2, tp_handler=TorchTensorParallelConfig(
            tp_plan={"layers.*.k_proj": "colwise"})))
    with pytest.raises(ConfigurationError, match=r"does not divide layer 'layers.0.q_proj'.*out_features is 8.*8 % 3 = 2"):
        check_tp_plan(model, plan, 3)
    with pytest.raises(ConfigurationError, match="has no tensor-parallel plan"):
        resolve_tp_plan(_model(), ParallelismConfig(tp_size=2))


def test_a_transformers_model_brings_its_own_plan():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config)
    plan = resolve_tp_plan(model, ParallelismConfig(tp_size=2))
    assert plan["model.layers.0.self_attn.q_proj"] == "colwise"
    assert plan["model.layers.1.self_attn.o_proj"] == "rowwise"
    assert plan["model.layers.1.mlp.down_proj"] == "rowwise"
    check_tp_plan(model, plan, 2)  # every split width of this model is even


# ------------------------------------------------------------------------------ 4 gloo ranks
@pytest.mark.world_size(4, timeout=400)
def test_hsdp_matches_ddp_and_tp_matches_one_process(tmp_path):
    # DDP on 4 ranks (plain replication) is the ground truth for HSDP 2x2, with accumulation over 2 micro-steps.
    runs = {}
    for name, config in (("ddp", _config(replicate=4)), ("hsdp", _config(replicate=2, shard=2))):
        accelerator, model, optimizer = _prepared(config, gradient_accumulation_steps=2)
        _train(accelerator, model, optimizer, range(4))
        runs[name] = _full(accelerator, model)
        if name == "hsdp":
            mesh = accelerator.torch_device_mesh
            assert mesh.mesh_dim_names == ("dp_replicate", "dp_shard") and mesh["dp"].size() == 4
    if dist.get_rank() == 0:
        assert _max_diff(runs["hsdp"], runs["ddp"]) < ATOL

    # TP 2 (with 2 replicas) and FSDP2 + TP 2x2: logits and weights equal a plain single-process run.
    plain = _model()
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=0.05)
    for step in range(3):
        x, y = _batch(step)
        nn.functional.mse_loss(plain(x), y).backward()
        plain_optimizer.step()
        plain_optimizer.zero_grad()
    probe = _batch(99)[0]
    for config in (_config(replicate=2, tp=2), _config(shard=2, tp=2)):
        accelerator, model, optimizer = _prepared(config)
        assert accelerator.torch_device_mesh["tp"].size() == 2
        weight = model[0].weight  # really split: a DTensor on a mesh with "tp", holding a quarter/half of (16, 6)
        assert "tp" in weight.device_mesh.mesh_dim_names and weight.to_local().numel() < 16 * 6
        _train(accelerator, model, optimizer, range(3))
        with torch.no_grad():
            logits = model(probe)
        assert (logits - plain(probe).detach()).abs().max().item() < ATOL, config
        weights = _full(accelerator, model)
        if dist.get_rank() == 0:
            assert _max_diff(weights, {k: v.detach() for k, v in plain.state_dict().items()}) < ATOL, config


@pytest.mark.world_size(4, timeout=400)
def test_one_mesh_per_run_data_follows_it_and_metrics_gather_each_sample_once():
    from unittest import mock

    from torch.distributed import device_mesh

    from hasten.state import AcceleratorState

    builds = {"build_device_mesh": 0, "init_device_mesh": 0}

    def counted(name, real):
        def call(*args, **kwargs):
            builds[name] += 1
            return real(*args, **kwargs)
        return call

    with mock.patch.object(ParallelismConfig, "build_device_mesh",
                           counted("build_device_mesh", ParallelismConfig.build_device_mesh)), \
         mock.patch.object(device_mesh, "init_device_mesh", counted("init_device_mesh", device_mesh.init_device_mesh)):
        accelerator, model, optimizer = _prepared(_config(shard=2, tp=2))
        _train(accelerator, model, optimizer, range(2))
        mine, everyone, gathered = _read_through_mesh(accelerator, 10)
    # built once, by the one builder, and handed to whoever needs it
    assert builds == {"build_device_mesh": 1, "init_device_mesh": 1}
    mesh = accelerator.torch_device_mesh
    assert mesh is accelerator.parallelism_config.device_mesh is AcceleratorState().device_mesh
    assert accelerator._strategy.world_mesh is mesh and accelerator._strategy.device_mesh.mesh_dim_names == ("dp_shard",)
    rank = dist.get_rank()
    assert (accelerator.num_processes, accelerator._data_parallel_position()) == (4, (2, rank // 2))
    assert (accelerator.data_parallel_shard_rank, accelerator.tensor_parallel_rank) == (rank // 2, rank % 2)
    assert (accelerator.data_parallel_rank, accelerator.context_parallel_rank) == (0, 0)  # not in use: 0
    assert accelerator.is_composable_parallelism_enabled
    assert torch.equal(everyone[0], everyone[1]) and torch.equal(everyone[2], everyone[3])  # TP pairs share
    assert not torch.equal(everyone[0], everyone[2])  # the two data-parallel ranks do not
    assert sorted(torch.cat(gathered).tolist()) == [float(i) for i in range(10)]  # once each, padding dropped
    # Accelerate's prepare_data_loader(torch_device_mesh=...) shards the same way, over the mesh's "dp" view.
    from hasten.data import prepare_data_loader

    by_mesh = prepare_data_loader(torch.utils.data.DataLoader(torch.arange(10).float(), batch_size=2),
                                  torch_device_mesh=accelerator.torch_device_mesh, put_on_device=False)
    assert torch.equal(torch.cat(list(by_mesh)), mine)


@pytest.mark.world_size(4, timeout=400)
def test_save_on_one_mesh_load_on_another_continue_and_merge(tmp_path):
    folder = tmp_path / "ckpt"
    accelerator, model, optimizer = _prepared(_config(shard=4))
    _train(accelerator, model, optimizer, range(2))
    accelerator.save_state(folder)
    at_save = _full(accelerator, model)
    _train(accelerator, model, optimizer, range(2, 4))
    uninterrupted = _full(accelerator, model)

    accelerator, model, optimizer = _prepared(_config(shard=2, tp=2))  # another mesh: weights and Adam state reshard
    accelerator.load_state(folder)
    _train(accelerator, model, optimizer, range(2, 4))
    resumed = _full(accelerator, model)
    if dist.get_rank() == 0:
        assert _max_diff(resumed, uninterrupted) < ATOL
        from hasten.commands.main import main

        assert main(["merge-weights", str(folder), str(tmp_path / "merged")]) == 0  # `hasten merge-weights`
        plain = _model()
        plain.load_state_dict(load_file(str(tmp_path / "merged" / "model.safetensors")))  # a plain model loads it
        assert _max_diff({k: v.detach() for k, v in plain.state_dict().items()}, at_save) == 0.0
    accelerator.wait_for_everyone()


@pytest.mark.world_size(2, timeout=300)
def test_context_parallel_mesh_and_sequence_split_on_cpu_and_why_attention_is_refused():
    """What can run on the CPU: the cp mesh and PyTorch's load-balanced sequence split; attention cannot."""
    import torch.nn.functional as F
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    config = ParallelismConfig(cp_size=2)
    assert (config.data_parallel_size, config.non_data_parallel_size) == (1, 2)  # both ranks read the same batch
    mesh = config.build_device_mesh("cpu")
    assert mesh.mesh_dim_names == ("dp_shard", "cp") and mesh["cp"].size() == 2
    tokens = torch.arange(16.0).view(1, 1, 16, 1).repeat(1, 2, 1, 4)  # (batch, heads, seq, head_dim)
    original = tokens.clone()
    with context_parallel(mesh["cp"], buffers=[tokens], buffer_seq_dims=[2]):
        # load balancing for causal attention: rank r holds chunks r and 3 - r of 4
        rank = dist.get_rank()
        expected = torch.cat([original[:, :, 4 * rank:4 * rank + 4], original[:, :, 4 * (3 - rank):4 * (4 - rank)]], 2)
        assert torch.equal(tokens, expected)
        with pytest.raises(NotImplementedError, match="_scaled_dot_product_flash_attention_for_cpu"):
            F.scaled_dot_product_attention(tokens, tokens, tokens, is_causal=True)
        (whole,) = context_parallel_unshard(mesh["cp"], [tokens], [2])
        assert torch.equal(whole, original)
    assert torch.equal(tokens, original)  # restored after the block


@pytest.mark.world_size(2, timeout=300)
def test_tp_size_not_dividing_a_layer_is_one_clear_error_on_every_rank():
    reset_state()
    accelerator = Accelerator(cpu=True, parallelism_config=ParallelismConfig(
        tp_size=2, tp_handler=TorchTensorParallelConfig(tp_plan={"0": "colwise", "2": "rowwise"})))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 15), nn.Tanh(), nn.Linear(15, 3))
    with pytest.raises(ConfigurationError, match=r"tp_size=2 does not divide layer '0'.*out_features is 15"):
        accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert not hasattr(model[0].weight, "device_mesh")  # nothing was split
    accelerator.wait_for_everyone()  # every rank raised and is still in step


@pytest.mark.world_size(2, timeout=300)
def test_a_transformers_model_runs_tensor_parallel_on_its_own_plan():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(config)
    reset_state()
    accelerator = Accelerator(cpu=True, parallelism_config=ParallelismConfig(tp_size=2))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert model.model.layers[0].self_attn.q_proj.weight.to_local().shape == (8, 16)  # half the heads per rank
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(tokens).logits
        expected = plain(tokens).logits
    assert (logits - expected).abs().max().item() < ATOL


# ------------------------------------------------------------------------ 8 gloo ranks: HSDP + TP
def _plain_run(steps: range, accumulation: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The ground truth: one process, the whole global batch, a step every `accumulation` micro-batches."""
    plain = _model()
    optimizer = torch.optim.AdamW(plain.parameters(), lr=0.05)
    for step in steps:
        x, y = _batch(step)
        (nn.functional.mse_loss(plain(x), y) / accumulation).backward()
        if (step + 1) % accumulation == 0:
            optimizer.step()
            optimizer.zero_grad()
    return plain, optimizer


@pytest.mark.world_size(8, timeout=400)
def test_hsdp_plus_tp_on_a_3d_mesh_matches_one_process_and_shards_data_over_dp_only():
    """dp_replicate=2 x dp_shard=2 x tp=2 on 8 ranks: the 3-D mesh, with accumulation over 2 micro-steps."""
    accelerator, model, optimizer = _prepared(_config(replicate=2, shard=2, tp=2), gradient_accumulation_steps=2)
    rank = dist.get_rank()
    mesh = accelerator.torch_device_mesh
    assert mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "tp") and tuple(mesh.shape) == (2, 2, 2)
    assert (mesh["dp"].size(), mesh["dp_shard_cp"].size(), mesh["dp_cp"].size()) == (4, 2, 4)
    # Neighbouring ranks form a TP pair; replication is outermost.
    assert (accelerator.data_parallel_rank, accelerator.data_parallel_shard_rank,
            accelerator.tensor_parallel_rank) == (rank // 4, rank // 2 % 2, rank % 2)
    assert (accelerator.num_processes, accelerator.process_index) == (8, rank)
    assert accelerator._data_parallel_position() == (4, rank // 2)
    weight = model[0].weight  # (16, 6): rows split over tp, then over dp_shard; whole on each replica
    assert set(weight.device_mesh.mesh_dim_names) == {"dp_replicate", "dp_shard", "tp"}
    assert weight.to_local().numel() == 16 * 6 // 4

    _train(accelerator, model, optimizer, range(6))  # 3 optimizer steps
    plain, _ = _plain_run(range(6), accumulation=2)
    probe = _batch(99)[0]
    with torch.no_grad():
        logits = model(probe)
    assert (logits - plain(probe).detach()).abs().max().item() < ATOL
    weights = _full(accelerator, model)
    if rank == 0:
        assert _max_diff(weights, {k: v.detach() for k, v in plain.state_dict().items()}) < ATOL

    # Data follows the mesh: the two ranks of a TP pair read the same batches, the 4 data-parallel ranks
    # different ones, and gather_for_metrics returns the 18 samples once each (padding to 4 x 3 x 2 dropped).
    _mine, everyone, gathered = _read_through_mesh(accelerator, 18)
    for pair in range(4):
        assert torch.equal(everyone[2 * pair], everyone[2 * pair + 1])
    assert len({tuple(everyone[2 * pair].tolist()) for pair in range(4)}) == 4
    assert sorted(torch.cat(gathered).tolist()) == [float(i) for i in range(18)]


def _save_on_3d_mesh(folder: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """8 ranks, HSDP + TP 2x2x2: two optimizer steps, save, two more: (weights at save, uninterrupted run)."""
    accelerator, model, optimizer = _prepared(_config(replicate=2, shard=2, tp=2), gradient_accumulation_steps=2)
    _train(accelerator, model, optimizer, range(4))
    accelerator.save_state(folder)
    at_save = _full(accelerator, model)
    _train(accelerator, model, optimizer, range(4, 8))
    return at_save, _full(accelerator, model)


def _resume_on_hsdp(folder: str) -> dict[str, torch.Tensor]:
    """4 ranks, HSDP 2x2 without TP: the TP-split weights and Adam moments are reassembled from the checkpoint."""
    accelerator, model, optimizer = _prepared(_config(replicate=2, shard=2), gradient_accumulation_steps=2)
    # Processes 4..7's RNG states have no process to go to, and the main process says so.
    says = pytest.warns(UserWarning, match="saved by 8 processes and is loaded into 4: dropped the random generator")
    with says if accelerator.is_main_process else contextlib.nullcontext():
        accelerator.load_state(folder)
    _train(accelerator, model, optimizer, range(4, 8))
    return _full(accelerator, model)


def test_save_on_the_3d_mesh_continue_on_a_4_rank_mesh_and_merge(tmp_path):
    """Saved by HSDP + TP on 8 ranks, resumed by HSDP 2x2 on 4: ends where the uninterrupted 8-rank run ends.

    Tolerance 1e-5: the checkpoint round trip is exact (DCP writes the fp32 values, loading onto another
    mesh only copies them into other shards), and both meshes have 4 data-parallel ranks reading the same
    batches, so the runs differ only in the TP split of the matmuls (partial products summed by an
    all-reduce): measured 6e-8. Resuming without the Adam moments moves these weights by 0.16, one step
    fewer by 0.05.
    """
    folder = str(tmp_path / "ckpt")
    at_save, uninterrupted = run_on_ranks(_save_on_3d_mesh, world_size=8, args=(folder,), timeout=300)[0]
    resumed = run_on_ranks(_resume_on_hsdp, world_size=4, args=(folder,), timeout=300)[0]
    assert _max_diff(resumed, uninterrupted) < ATOL
    plain, _ = _plain_run(range(8), accumulation=2)  # and both are the one-process run
    assert _max_diff(uninterrupted, {k: v.detach() for k, v in plain.state_dict().items()}) < ATOL
    # `hasten merge-weights` joins the TP-and-FSDP-split pieces into one file a plain model loads, exactly.
    from hasten.commands.main import main

    assert main(["merge-weights", folder, str(tmp_path / "merged")]) == 0
    merged = _model()
    merged.load_state_dict(load_file(str(tmp_path / "merged" / "model.safetensors")))
    assert _max_diff({k: v.detach() for k, v in merged.state_dict().items()}, at_save) == 0.0
