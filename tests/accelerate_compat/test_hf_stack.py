"""Transformers' Trainer, TRL and PEFT run on hasten unchanged (tiny models from configs, synthetic data, no hub).

They run in the Hugging Face venv ``make test`` builds (trl, peft, datasets; no Accelerate): under
``hasten launch`` its workers install hasten as ``accelerate``; plain ``python`` scripts call
``hasten.install_as_accelerate()`` first. Each test is one subprocess (importing transformers costs seconds),
so each script checks several things and reports them in one line.
"""

import json
from pathlib import Path

import pytest

from helpers.hf_stack import ROOT, accelerate_python, hasten_launch, hf_python, run

pytestmark = pytest.mark.launch

SCRIPTS = Path(__file__).resolve().parent / "hf_scripts"
TRAINER = str(SCRIPTS / "tiny_trainer.py")


def _result(out):
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, out[-3000:]
    return json.loads(lines[0][len("RESULT "):])


def _check_run(result, processes, precision):
    assert result["processes"] == processes and result["mixed_precision"] == precision
    assert sorted(result["losses"], key=int) == ["1", "2", "3", "4", "5", "6"]
    # resumed mid-epoch from checkpoint-3: the same losses and bit-identical final weights
    assert result["resumed_losses"] == {k: v for k, v in result["losses"].items() if int(k) > 3}
    assert result["resume_equal"] is True
    assert result["prediction_shape"] == [22, 2]  # every sample predicted once (uneven last batch on 2 ranks)
    assert result["eval_loss"] > 0


def test_walkthrough_trainer_subclass_under_notebook_launcher(tmp_path):
    out = run([hf_python(), str(ROOT / "examples" / "mnist_trainer.py"), "--train_size", "128"], tmp_path)
    assert "processes=2 steps=1/1" in out


def test_trainer_under_hasten_launch_two_processes_bf16(tmp_path):
    result = _result(hasten_launch(tmp_path, "--cpu", "--num_processes", "2", "--mixed_precision", "bf16", TRAINER,
                                   "--dropout", "0.1"))  # exact resume with dropout: the RNG stream is restored
    _check_run(result["default"], processes=2, precision="bf16")
    assert (tmp_path / "out" / "default" / "final" / "model.safetensors").is_file()


def test_trainer_under_plain_python(tmp_path):
    result = _result(run([hf_python(), TRAINER, "--alias"], tmp_path))
    _check_run(result["default"], processes=1, precision="no")


def test_trainer_fsdp2_both_state_dict_types_and_resume(tmp_path):
    config = tmp_path / "fsdp.yaml"
    config.write_text("distributed_type: FSDP\nuse_cpu: true\nnum_processes: 2\nmixed_precision: 'no'\nfsdp_config:\n"
                      "  fsdp_version: 2\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
                      "  fsdp_transformer_layer_cls_to_wrap: BertLayer\n")
    result = _result(hasten_launch(tmp_path, "--config_file", str(config), TRAINER,
                                   "--state_dict_types", "SHARDED_STATE_DICT,FULL_STATE_DICT"))
    for kind in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
        _check_run(result[kind], processes=2, precision="no")
    assert result["SHARDED_STATE_DICT"]["losses"] == result["FULL_STATE_DICT"]["losses"]
    # Accelerate's file layout, written by save_fsdp_model / save_fsdp_optimizer
    sharded = tmp_path / "out" / "SHARDED_STATE_DICT" / "checkpoint-3"
    assert (sharded / "pytorch_model_fsdp_0" / ".metadata").is_file()
    assert (sharded / "optimizer_0" / ".metadata").is_file()
    full = tmp_path / "out" / "FULL_STATE_DICT" / "checkpoint-3"
    assert (full / "pytorch_model_fsdp.bin").is_file() and (full / "optimizer.bin").is_file()


@pytest.fixture(scope="module")
def peft_trl_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("peft-trl")
    return run([hf_python(), str(SCRIPTS / "peft_trl.py"), str(folder)], folder)


@pytest.mark.parametrize("section", ["lora_resume", "sft_plain", "sft_packing", "sft_lora", "dpo_grpo_import",
                                     "disk_offload"])
def test_peft_and_trl(section, peft_trl_run):
    assert f"OK {section}" in peft_trl_run


@pytest.mark.parametrize("processes", [1, 2])
def test_same_losses_as_accelerate_with_dropout(tmp_path, processes):
    """The same script, switched from Accelerate 1.15 to hasten: every logged loss is bit-identical."""
    args = [TRAINER, "--no_resume", "--dropout", "0.1"]
    (tmp_path / "accelerate").mkdir()
    (tmp_path / "hasten").mkdir()
    if processes == 1:
        theirs = run([accelerate_python(), *args], tmp_path / "accelerate")
        ours = run([hf_python(), *args, "--alias"], tmp_path / "hasten")
    else:
        # Accelerate's CPU processes under torchrun (free port), with the variable `accelerate launch --cpu` sets
        theirs = run([accelerate_python(), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                      *args], tmp_path / "accelerate", ACCELERATE_USE_CPU="True")
        ours = hasten_launch(tmp_path / "hasten", "--cpu", "--num_processes", "2", *args)
    theirs, ours = _result(theirs)["default"], _result(ours)["default"]
    assert theirs["processes"] == ours["processes"] == processes
    assert ours["losses"] == theirs["losses"]
    assert ours["eval_loss"] == theirs["eval_loss"]


@pytest.mark.parametrize("trainer, extra", [("trainer", ["--accumulation", "2", "--tied"]), ("sft", [])])
def test_trainer_and_sft_trainer_with_pp_size_2_from_the_launch_config_equal_pp_size_1(tmp_path, trainer, extra):
    """The same script, pp_size=2 set only in the launch config: losses, final weights and Trainer's evaluation
    loss as on one process (padded batches, gradient accumulation with tied embeddings across the stages, TRL's
    fused-head loss)."""
    script = [str(SCRIPTS / "pp_trainer.py"), "--trainer", trainer, *extra]
    (tmp_path / "one").mkdir()
    (tmp_path / "pp").mkdir()
    config = tmp_path / "pp.yaml"
    config.write_text("distributed_type: MULTI_CPU\nuse_cpu: true\nnum_processes: 2\nmixed_precision: 'no'\n"
                      "parallelism_config:\n  parallelism_config_pp_size: 2\n  parallelism_config_pp_microbatches: 2\n")
    one = _result(run([hf_python(), *script, "--alias"], tmp_path / "one"))
    pp = _result(hasten_launch(tmp_path / "pp", "--config_file", str(config), *script))
    assert (one["processes"], one["pp_size"], pp["processes"], pp["pp_size"]) == (1, 1, 2, 2)
    assert sorted(pp["losses"]) == sorted(one["losses"]) == ["1", "2", "3"]
    for step, loss in one["losses"].items():
        assert pp["losses"][step] == pytest.approx(loss, rel=1e-5, abs=1e-5), step
    # evaluate(): the model's loss (and TRL's entropy, token accuracy, tokens) from the last stage's outputs
    for key in {key for key in one["eval"] if not key.endswith(("_runtime", "_per_second"))}:
        assert pp["eval"][key] == pytest.approx(one["eval"][key], rel=1e-5, abs=1e-6), key
    import torch
    from safetensors.torch import load_file

    want, got = torch.load(tmp_path / "one" / "weights.pt"), torch.load(tmp_path / "pp" / "weights.pt")
    # accelerator.save_model on every process (the documented save under pp_size > 1) writes the full model
    saved = load_file(tmp_path / "pp" / "final" / "model.safetensors")
    assert sorted(got) == sorted(want)
    assert set(saved) <= set(want) and {n for n in want if n not in saved} <= {"lm_head.weight"}  # tied: once
    for name, weight in want.items():
        assert torch.allclose(got[name], weight, rtol=0, atol=1e-5), name
        if name in saved:
            assert torch.allclose(saved[name], weight, rtol=0, atol=1e-5), name


def test_trainer_checkpoint_of_one_process_resumes_under_pp_size_2_as_the_uninterrupted_run(tmp_path):
    """Trainer resumes a checkpoint saved without pipeline parallelism under pp_size=2, unchanged: its
    ``optimizer.load_state_dict`` of the full model's state lands on each stage's parameters, so the resumed
    step's loss, the evaluation loss and the final weights are the uninterrupted one-process run's (1e-5)."""
    script = [str(SCRIPTS / "pp_trainer.py"), "--accumulation", "2", "--tied"]
    (tmp_path / "one").mkdir()
    (tmp_path / "pp").mkdir()
    config = tmp_path / "pp.yaml"
    config.write_text("distributed_type: MULTI_CPU\nuse_cpu: true\nnum_processes: 2\nmixed_precision: 'no'\n"
                      "parallelism_config:\n  parallelism_config_pp_size: 2\n  parallelism_config_pp_microbatches: 2\n")
    one = _result(run([hf_python(), *script, "--save_steps", "2", "--alias"], tmp_path / "one"))
    checkpoint = tmp_path / "one" / "out" / "checkpoint-2"
    pp = _result(hasten_launch(tmp_path / "pp", "--config_file", str(config), *script, "--resume", str(checkpoint)))
    assert (one["processes"], pp["processes"], pp["pp_size"]) == (1, 2, 2)
    assert list(pp["losses"]) == ["3"]
    assert pp["losses"]["3"] == pytest.approx(one["losses"]["3"], rel=1e-5, abs=1e-5)
    assert pp["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5)
    import torch

    want, got = torch.load(tmp_path / "one" / "weights.pt"), torch.load(tmp_path / "pp" / "weights.pt")
    assert sorted(got) == sorted(want)
    for name, weight in want.items():
        assert torch.allclose(got[name], weight, rtol=0, atol=1e-5), name


def _pp_config(tmp_path, pp_size):
    config = tmp_path / f"pp{pp_size}.yaml"
    config.write_text(f"distributed_type: MULTI_CPU\nuse_cpu: true\nnum_processes: {pp_size}\nmixed_precision: 'no'\n"
                      f"parallelism_config:\n  parallelism_config_pp_size: {pp_size}\n"
                      "  parallelism_config_pp_microbatches: 2\n")
    return str(config)


def _assert_close(got, want, atol, where):
    import torch

    assert sorted(got) == sorted(want), where
    for name, value in want.items():
        assert got[name].shape == value.shape and torch.allclose(got[name], value, rtol=0, atol=atol), (where, name)


def test_trainer_checkpoints_under_pp_size_2_are_one_process_checkpoints_and_resume_on_any_pp_size(tmp_path):
    """Trainer's own checkpoints (save_strategy="steps", trainer.save_model()) under pp_size=2 from the launch
    config, unchanged: the main process writes them alone, reading the other stage's state from its state
    server. The last checkpoint and trainer.save_model() hold exactly the run's own final weights (gathered by
    every process); each checkpoint has the pp_size=1 run's keys, its weights within 1e-5 (the pipeline's
    numerics: measured 1.2e-6, Adam amplifying gradient differences of float rounding) and optimizer.pt's
    state within 1e-6 (measured 4e-9); resuming one under pp_size=2 or pp_size=1 ends where the uninterrupted
    run does (1e-5); every process exits 0."""
    import torch
    from safetensors.torch import load_file

    script = [str(SCRIPTS / "pp_trainer.py"), "--accumulation", "2", "--tied", "--save_steps", "2",
              "--save_model", "saved"]
    for name in ("one", "pp", "resumed_pp", "resumed_one"):
        (tmp_path / name).mkdir()
    one = _result(run([hf_python(), *script, "--alias"], tmp_path / "one"))
    pp = _result(hasten_launch(tmp_path / "pp", "--config_file", _pp_config(tmp_path, 2), *script))
    assert (one["processes"], pp["processes"], pp["pp_size"]) == (1, 2, 2)
    for checkpoint in ("checkpoint-2", "checkpoint-3"):
        want, got = tmp_path / "one" / "out" / checkpoint, tmp_path / "pp" / "out" / checkpoint
        _assert_close(load_file(got / "model.safetensors"), load_file(want / "model.safetensors"), 1e-5, checkpoint)
        want_opt, got_opt = (torch.load(folder / "optimizer.pt", weights_only=False) for folder in (want, got))
        assert got_opt["param_groups"] == want_opt["param_groups"]
        assert sorted(got_opt["state"]) == sorted(want_opt["state"])
        for index, state in want_opt["state"].items():
            _assert_close(got_opt["state"][index], state, 1e-6, (checkpoint, index))
    # trainer.save_model() at the end and the last checkpoint: the full model, exactly the run's own
    final = torch.load(tmp_path / "pp" / "weights.pt")
    for folder in ("saved", "out/checkpoint-3"):
        saved = load_file(tmp_path / "pp" / folder / "model.safetensors")
        assert sorted(saved) == sorted(load_file(tmp_path / "one" / folder / "model.safetensors")), folder
        _assert_close(saved, {name: final[name] for name in saved}, 0.0, folder)
    resume = ["--resume", str(tmp_path / "pp" / "out" / "checkpoint-2")]
    resumed = {"resumed_pp": _result(hasten_launch(tmp_path / "resumed_pp", "--config_file", _pp_config(tmp_path, 2),
                                                   *script, *resume)),
               "resumed_one": _result(run([hf_python(), *script, *resume, "--alias"], tmp_path / "resumed_one"))}
    want = torch.load(tmp_path / "one" / "weights.pt")
    for name, result in resumed.items():
        assert list(result["losses"]) == ["3"], name
        assert result["losses"]["3"] == pytest.approx(one["losses"]["3"], rel=1e-5, abs=1e-5), name
        _assert_close(torch.load(tmp_path / name / "weights.pt"), want, 1e-5, name)
