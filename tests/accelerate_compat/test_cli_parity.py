"""``hasten``'s command line accepts every option of ``accelerate``'s (issue 15, item 3).

Accelerate's options come from the committed inventory (tools/accelerate_inventory.py records them).
Options whose feature hasten refuses parse, then stop the launch with one clear message and exit 2.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import tomllib

from hasten.commands.main import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
CLI = json.loads((ROOT / "tests" / "fixtures" / "accelerate_inventory.json").read_text())["cli_options"]


def _subparser(command: str) -> argparse.ArgumentParser:
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    raise AssertionError("no subcommands")


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {option: action for action in parser._actions for option in action.option_strings}


@pytest.mark.parametrize("command", sorted(CLI))
def test_every_accelerate_option_is_accepted(command):
    mine = _options(_subparser(command))
    missing = [o for entry in CLI[command] for o in entry["options"] if o not in mine]
    assert not missing, f"hasten {command} lacks {missing}"


def test_launch_has_all_123_options_and_restricts_choices_like_accelerate():
    assert len(CLI["launch"]) == 123
    mine = _options(_subparser("launch"))
    for entry in CLI["launch"]:
        if entry["choices"] is None:
            continue
        ours = mine[entry["options"][0]].choices
        assert ours is not None and set(entry["choices"]) <= set(ours), entry["options"]
        extra = set(ours) - set(entry["choices"])
        assert extra <= {"torchxla_trace_once"}, (entry["options"], extra)  # Accelerate misspells this one
    for option in ("--dynamo_backend", "--dynamo_mode", "--fsdp_version"):
        assert mine[option].choices


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print('ran')\n")
    return str(path)


@pytest.mark.parametrize("flags,message", [
    (["--megatron_lm_tp_degree", "2"], "Megatron-LM is not available"),
    (["--use_megatron_lm"], "Megatron-LM launches are not available"),
    (["--tpu"], "TPU (XLA) launches are not available"),
    (["--tpu_cluster"], "TPUs are not supported"),
    (["--vm", "worker-1"], "TPUs are not supported"),
    (["--parallelism_config_sp_size", "2"], "sequence parallelism is not available"),
    (["--num_processes", "3", "--parallelism_config_tp_size", "2"], "= 2 processes, but the run has 3"),
    (["--aws_access_key_id", "AKIA"], "SageMaker"),
])
def test_refused_features_exit_2_with_a_message(flags, message, script, capsys):
    assert main(["launch", "--cpu", "--dry_run", *flags, script]) == 2
    assert message in capsys.readouterr().err


def test_accepted_new_options_reach_the_configuration(script, capsys):
    from hasten.commands.launch import resolve_config

    args = _subparser("launch").parse_args(["--cpu", "--fp8_backend", "ao", "--fp8-amax-history-len", "16",
                                            "--dynamo-backend", "INDUCTOR", "--no_tpu_cluster", script])
    config = resolve_config(args, {})
    assert config.fp8_config == {"backend": "ao", "amax_history_length": 16}
    assert config.dynamo_config["dynamo_backend"] == "inductor" and not config.tpu_use_cluster
    assert main(["launch", "--cpu", "--dry_run", "--parallelism_config_dp_shard_size", "1", script]) == 0


def test_unknown_option_gets_did_you_mean_and_exit_2(script, capsys):
    assert main(["launch", "--num_processs", "2", script]) == 2
    assert "--num_processs (did you mean --num_processes?)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["launch", "--dynamo_backend", "fastest", script])
    assert info.value.code == 2


def test_dashed_spellings_of_to_fsdp2_and_merge_weights():
    to_fsdp2 = _subparser("to-fsdp2").parse_args(["--config-file", "a.yaml", "--output-file", "b.yaml"])
    assert (to_fsdp2.config_file, to_fsdp2.output_file) == ("a.yaml", "b.yaml")
    merge = _subparser("merge-weights").parse_args(["ckpt", "out", "--unsafe-serialization",
                                                   "--remove-checkpoint-dir"])
    assert merge.unsafe_serialization and merge.remove_checkpoint_dir


def test_console_scripts_like_accelerates():
    import importlib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for name in ("hasten", "hasten-launch", "hasten-config", "hasten-estimate-memory", "hasten-merge-weights"):
        module, _, function = scripts[name].partition(":")
        assert callable(getattr(importlib.import_module(module), function)), name


def test_standalone_merge_weights_entry_point_reports_a_missing_checkpoint(tmp_path, capsys):
    from hasten.commands.merge import main as merge_main

    assert merge_main([str(tmp_path / "missing"), str(tmp_path / "out")]) != 0
    assert "missing" in capsys.readouterr().err
