"""``hasten launch`` exports the ``ACCELERATE_*`` / ``FSDP_*`` variables ``accelerate launch`` exports, same values.

Ground truth: Accelerate 1.15's own environment builders run on the same configuration file.
"""

import json
import sys

import pytest

from hasten.config.env import accelerate_launch_env, launch_config_to_env
from hasten.config.io import load_config_file
from helpers.hf_stack import accelerate_python, hasten_launch, hf_python, run, script

CONFIGS = {
    "cpu_bf16": "distributed_type: MULTI_CPU\nuse_cpu: true\nnum_processes: 2\nmixed_precision: bf16\n",
    "single_no": "distributed_type: 'NO'\nuse_cpu: true\nnum_processes: 1\nmixed_precision: 'no'\ndebug: true\n",
    "fsdp2": ("distributed_type: FSDP\nmixed_precision: bf16\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 2\n"
              "  fsdp_state_dict_type: SHARDED_STATE_DICT\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
              "  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer\n  fsdp_offload_params: false\n"
              "  fsdp_cpu_ram_efficient_loading: true\n  fsdp_activation_checkpointing: true\n"),
    "fsdp2_full": ("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 2\n"
                   "  fsdp_state_dict_type: FULL_STATE_DICT\n  fsdp_reshard_after_forward: false\n"),
}

ACCELERATE_ENV = """
import json, os, sys
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils.launch import prepare_multi_gpu_env, prepare_simple_launcher_cmd_env
args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", sys.argv[1], "x.py"]))
env = prepare_multi_gpu_env(args) if (args.use_fsdp or args.multi_gpu) else prepare_simple_launcher_cmd_env(args)[1]
print(json.dumps({k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_")) and os.environ.get(k) != v}))
"""


@pytest.fixture(scope="module")
def accelerates_env(tmp_path_factory):
    folder = tmp_path_factory.mktemp("accelerate-env")
    builder = script(folder, ACCELERATE_ENV, "env.py")
    found = {}
    for name, text in CONFIGS.items():
        (folder / f"{name}.yaml").write_text(text)
        found[name] = json.loads(run([accelerate_python(), builder, str(folder / f"{name}.yaml")],
                                     folder).strip().splitlines()[-1])
    return folder, found


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_same_variables_and_values_as_accelerate_launch(name, accelerates_env):
    folder, expected = accelerates_env
    config = load_config_file(folder / f"{name}.yaml").to_launch_dict()
    assert accelerate_launch_env(config) == expected[name]
    exported = launch_config_to_env(config)  # next to HASTEN_LAUNCH_CONFIG, from the same dict
    assert json.loads(exported.pop("HASTEN_LAUNCH_CONFIG")) == json.loads(json.dumps(config))
    assert exported == expected[name]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_accelerates_launcher_helpers_return_accelerates_values(name, accelerates_env):
    """The same script, on hasten through the alias: ``_validate_launch_command``, ``prepare_multi_gpu_env`` and
    ``prepare_simple_launcher_cmd_env`` return what Accelerate's return, instead of refusing (issue 35)."""
    folder, expected = accelerates_env
    on_hasten = script(folder, "import runpy, sys, hasten\nhasten.install_as_accelerate()\n"
                               "runpy.run_path(sys.argv.pop(1), run_name='__main__')\n", "on_hasten.py")
    out = run([hf_python(), on_hasten, str(folder / "env.py"), str(folder / f"{name}.yaml")], folder)
    assert json.loads(out.strip().splitlines()[-1]) == expected[name]


def test_launch_helpers_complete_the_namespace_and_build_the_command(tmp_path, monkeypatch):
    from hasten.commands.launch import launch_command_parser
    from hasten.commands.launch_env import (
        _convert_nargs_to_dict,
        _validate_launch_command,
        prepare_simple_launcher_cmd_env,
    )

    monkeypatch.delenv("HASTEN_CONFIG_FILE", raising=False)
    (tmp_path / "cpu.yaml").write_text(CONFIGS["cpu_bf16"])
    parsed = launch_command_parser().parse_args(["--config_file", str(tmp_path / "cpu.yaml"), "-m", "pkg.train", "--lr", "1"])
    args, defaults, mp_from_config = _validate_launch_command(parsed)
    assert (args.num_processes, args.mixed_precision, args.use_cpu, args.multi_gpu, args.use_fsdp) == (2, "bf16", True,
                                                                                                      False, False)
    assert defaults.num_processes == 2 and mp_from_config is True
    command, env = prepare_simple_launcher_cmd_env(args)
    assert command == [sys.executable, "-m", "pkg.train", "--lr", "1"]
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16" and env["MASTER_PORT"] == "29500"
    assert _convert_nargs_to_dict(["--epochs", "3", "--lr", "0.5", "--name", "x", "--fast", "True"]) == {
        "epochs": 3, "lr": 0.5, "name": "x", "fast": True}
    with pytest.raises(ValueError, match="store_true"):
        _convert_nargs_to_dict(["--fast", "--epochs", "3"])


@pytest.mark.launch
def test_trainer_agrees_with_the_launchers_precision(tmp_path):
    """TrainingArguments() takes mixed_precision from ACCELERATE_MIXED_PRECISION: no conflict with the launch."""
    code = """
        import os
        import hasten
        from transformers import TrainingArguments
        args = TrainingArguments(output_dir="out", report_to=[])
        acc = hasten.Accelerator(mixed_precision=args.mixed_precision)
        print("precision", os.environ["ACCELERATE_MIXED_PRECISION"], args.mixed_precision, acc.mixed_precision)
        """
    out = hasten_launch(tmp_path, "--cpu", "--num_processes", "1", "--mixed_precision", "bf16", script(tmp_path, code))
    assert "precision bf16 bf16 bf16" in out
