"""One schema for every configuration key: YAML -> CLI -> launch plan -> worker, and no key accepted then ignored.

Each ``LaunchConfig`` key gets a non-default value below (a new key fails the coverage test until it
is added here). For each one: the YAML file round-trips it, the ``hasten launch`` flag generated from
the schema sets the same value, and the plan either refuses it or hands the worker's typed
``LaunchConfig`` exactly the plan's configuration, with the value unchanged.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

from hasten.commands.launch import FLAGS, build_launch_parser, resolve_config
from hasten.config.env import launch_config
from hasten.config.io import load_config_file, save_config_file
from hasten.config.plugins.deepspeed import DeepSpeedPlugin
from hasten.config.plugins.fsdp import FullyShardedDataParallelPlugin
from hasten.config.schema import DEEPSPEED_KEYS, FSDP_KEYS, LaunchConfig
from hasten.exceptions import ConfigurationError
from hasten.launchers.plan import LaunchOptions, build_plan

SRC = Path(__file__).resolve().parents[2] / "src" / "hasten"

# key -> (the changed settings, the `hasten launch` argv that sets them); argv None: files only.
CHANGES: dict[str, tuple[dict[str, Any], list[str] | None]] = {
    "compute_environment": ({"compute_environment": "LOCAL_MACHINE"}, None),  # its only other value is refused
    "distributed_type": ({"distributed_type": "FSDP"}, ["--use_fsdp"]),
    "mixed_precision": ({"mixed_precision": "bf16"}, ["--mixed_precision", "bf16"]),
    "use_cpu": ({"use_cpu": True}, ["--cpu"]),
    "debug": ({"debug": True}, ["--debug"]),
    "num_processes": ({"num_processes": 3, "use_cpu": True}, ["--num_processes", "3", "--cpu"]),
    "machine_rank": ({"machine_rank": 1, "num_machines": 2, "num_processes": 2, "main_process_ip": "10.0.0.2",
                      "main_process_port": 29555, "use_cpu": True},
                     ["--machine_rank", "1", "--num_machines", "2", "--num_processes", "2", "--main_process_ip",
                      "10.0.0.2", "--main_process_port", "29555", "--cpu"]),
    "num_machines": ({"num_machines": 2, "num_processes": 2, "main_process_ip": "10.0.0.2", "use_cpu": True,
                      "main_process_port": 29556},
                     ["--num_machines", "2", "--num_processes", "2", "--main_process_ip", "10.0.0.2", "--cpu",
                      "--main_process_port", "29556"]),
    "gpu_ids": ({"gpu_ids": "0,1"}, ["--gpu_ids", "0,1"]),
    "main_process_ip": ({"main_process_ip": "127.0.0.1", "num_processes": 2, "use_cpu": True},
                        ["--main_process_ip", "127.0.0.1", "--num_processes", "2", "--cpu"]),
    "main_process_port": ({"main_process_port": 29557, "num_processes": 2, "use_cpu": True,
                           "num_machines": 2, "machine_rank": 1, "main_process_ip": "10.0.0.3"},
                          ["--main_process_port", "29557", "--num_processes", "2", "--cpu", "--num_machines", "2",
                           "--machine_rank", "1", "--main_process_ip", "10.0.0.3"]),
    "rdzv_backend": ({"rdzv_backend": "c10d", "num_processes": 2, "use_cpu": True},
                     ["--rdzv_backend", "c10d", "--num_processes", "2", "--cpu"]),
    "same_network": ({"same_network": True}, ["--same_network"]),
    "main_training_function": ({"main_training_function": "train"}, ["--main_training_function", "train"]),
    "enable_cpu_affinity": ({"enable_cpu_affinity": True}, ["--enable_cpu_affinity"]),
    "downcast_bf16": ({"downcast_bf16": True}, ["--downcast_bf16"]),
    "fp8_config": ({"fp8_config": {"margin": 2}}, ["--fp8_margin", "2"]),
    "deepspeed_config": ({"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": "3"}},
                         ["--use_deepspeed", "--zero_stage", "3"]),
    "fsdp_config": ({"distributed_type": "FSDP", "fsdp_config": {"fsdp_reshard_after_forward": "false"}},
                    ["--use_fsdp", "--fsdp_reshard_after_forward", "false"]),
    "parallelism_config": ({"parallelism_config": {"parallelism_config_tp_size": 2}},
                           ["--parallelism_config_tp_size", "2"]),
    "megatron_lm_config": ({"megatron_lm_config": {"megatron_lm_tp_degree": "2"}}, ["--megatron_lm_tp_degree", "2"]),
    "mpirun_config": ({"mpirun_config": {"mpirun_ccl": 1}}, None),
    "dynamo_config": ({"dynamo_config": {"dynamo_backend": "eager"}}, ["--dynamo_backend", "eager"]),
    "tpu_name": ({"tpu_name": "pod"}, None),
    "tpu_zone": ({"tpu_zone": "us-c1"}, None),
    "tpu_use_cluster": ({"tpu_use_cluster": True}, ["--tpu_cluster"]),
    "tpu_use_sudo": ({"tpu_use_sudo": True}, ["--tpu_use_sudo"]),
    "command_file": ({"command_file": "cmds.sh"}, None),
    "commands": ({"commands": ["echo hi"]}, None),
    "tpu_vm": ({"tpu_vm": ["vm1"]}, ["--vm", "vm1"]),
    "tpu_env": ({"tpu_env": ["A=1"]}, ["--env", "A=1"]),
    "use_parallelism_config": ({"use_parallelism_config": True}, ["--use_parallelism_config"]),
    "min_machines": ({"min_machines": 2, "num_machines": 3, "num_processes": 3, "main_process_ip": "10.0.0.2",
                      "use_cpu": True, "main_process_port": 29558},
                     ["--num_machines", "2:3", "--num_processes", "3", "--main_process_ip", "10.0.0.2", "--cpu",
                      "--main_process_port", "29558"]),
    "preemption_signal": ({"preemption_signal": "USR1"}, ["--preemption_signal", "USR1"]),
    "replica_groups": ({"replica_groups": 2, "num_processes": 2, "use_cpu": True},
                       ["--replica_groups", "2", "--num_processes", "2", "--cpu"]),
}


def test_every_key_has_a_case():
    assert set(CHANGES) == {f.name for f in dataclasses.fields(LaunchConfig)}


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("")
    return str(path)


@pytest.mark.parametrize("key", sorted(CHANGES))
def test_key_round_trips_yaml_cli_plan_worker(key: str, tmp_path: Path, script: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HASTEN_HOME", str(tmp_path / "home"))
    changes, argv = CHANGES[key]
    expected = LaunchConfig().replace(**changes)
    assert getattr(expected, key) != getattr(LaunchConfig(), key) or key == "compute_environment"

    # YAML: written and read back unchanged.
    path = save_config_file(expected, tmp_path / "config.yaml")
    assert load_config_file(path) == expected

    # CLI: the flags generated from the schema set the same values (over an empty configuration file).
    if argv is not None:
        empty = save_config_file(LaunchConfig(), tmp_path / "empty.yaml")
        args = build_launch_parser(__import__("argparse").ArgumentParser()).parse_args(
            ["--config_file", str(empty), *argv, script])
        assert resolve_config(args, {}) == expected

    # Plan -> worker: refused with a clear error, or the worker's typed config is the plan's, value unchanged.
    try:
        plan = build_plan(expected, LaunchOptions(script=script), {}, device_count=0)
    except ConfigurationError as exc:  # the message names the setting (its key, a block key, or its flag)
        names = {*changes, *(k for v in changes.values() if isinstance(v, dict) for k in v),
                 *(a for a in argv or () if a.startswith("--"))}
        assert any(name in str(exc) for name in names), exc
        return
    worker = launch_config(plan.env)
    assert worker == plan.config
    for name, value in changes.items():
        if name not in ("main_process_ip", "main_process_port"):  # the plan may pick a free port / loopback
            assert getattr(worker, name) == value


def _read_outside_schema(name: str) -> bool:
    """True when some module other than the schema, the file I/O and the flag table reads the key."""
    pattern = re.compile(rf"\.{name}\b|[\"']{name}[\"']")
    skip = {"config/schema.py", "config/io.py", "commands/launch.py", "commands/questionnaire.py"}
    return any(pattern.search(path.read_text()) for path in SRC.rglob("*.py")
               if path.relative_to(SRC).as_posix() not in skip)


@pytest.mark.parametrize("key", sorted(f.name for f in dataclasses.fields(LaunchConfig)
                                        if f.name != "compute_environment"))  # one accepted value: nothing to read
def test_no_key_is_accepted_and_ignored(key: str) -> None:
    assert _read_outside_schema(key), f"LaunchConfig.{key} is read by nothing: implement it or refuse it"


@pytest.mark.parametrize("block,plugin", [("fsdp_config", FullyShardedDataParallelPlugin),
                                          ("deepspeed_config", DeepSpeedPlugin)])
def test_block_keys_feed_a_plugin_field_or_the_launcher(block: str, plugin: type) -> None:
    keys = FSDP_KEYS if block == "fsdp_config" else DEEPSPEED_KEYS
    parameters = inspect.signature(plugin).parameters
    plan_source = (SRC / "launchers" / "plan.py").read_text()
    for key in keys:
        if key.plugin_field is None:
            assert f'"{key.name}"' in plan_source, f"{block}.{key.name} is read by neither a plugin nor the launcher"
        else:
            assert key.plugin_field in parameters, f"{block}.{key.name} -> {plugin.__name__}({key.plugin_field}=)"
    flags = {flag for flag, _key, where, _kwargs, _text in FLAGS if where == block}
    assert flags == {f"--{key.name}" for key in keys if key.flag}  # the CLI comes from the same table


def test_launcher_only_deepspeed_keys_are_refused(script: str) -> None:
    config = LaunchConfig(distributed_type="DEEPSPEED", deepspeed_config={"deepspeed_hostfile": "hosts"})
    with pytest.raises(ConfigurationError, match="deepspeed_hostfile"):
        build_plan(config, LaunchOptions(script=script), {}, device_count=0)
    standard = LaunchConfig(distributed_type="DEEPSPEED", deepspeed_config={"deepspeed_multinode_launcher": "standard"})
    assert build_plan(standard, LaunchOptions(script=script), {}, device_count=0).config.deepspeed_config


def test_use_parallelism_config_without_sizes_gives_a_default_config():
    from hasten.config.parallelism import ParallelismConfig
    from hasten.connector import resolve_settings

    settings = resolve_settings({}, LaunchConfig(use_parallelism_config=True))
    assert isinstance(settings.parallelism_config, ParallelismConfig)
    assert settings.parallelism_config.total_size == 1
    assert resolve_settings({}, LaunchConfig()).parallelism_config is None
