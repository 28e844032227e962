"""Pipeline parallelism with the Hugging Face stack beyond a bare transformers model: a PEFT (LoRA) wrapper in the
ordinary loop, in Trainer and in SFTTrainer(peft_config=...), and SFTTrainer's evaluation, each against the same
script on one process. Like test_hf_stack.py, each test runs a script with the Hugging Face interpreter."""

import json
from pathlib import Path

import pytest

from helpers.hf_stack import hasten_launch, hf_python, run

pytestmark = pytest.mark.launch

SCRIPTS = Path(__file__).resolve().parent / "hf_scripts"


def _result(out):
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, out[-3000:]
    return json.loads(lines[0][len("RESULT "):])


def test_lora_model_in_the_ordinary_loop_under_pp_equals_one_process(tmp_path):
    """``get_peft_model(llama)`` under pp_size 2 (untied and tied embeddings), 3 (split points under the
    transformers model's names) and PP2 x FSDP2(2) (the same batches on both data-parallel ranks): cut by the base model's plan under the wrapper's names, the LoRA gradients within
    1e-6 of one process, the frozen base weights untouched, and ``get_state_dict``/``save_model`` (full weights)
    and ``save_pretrained(state_dict=...)`` (the adapter, every stage's) under PEFT's names as without PP."""
    report = _result(run([hf_python(), str(SCRIPTS / "pp_peft_loop.py"), str(tmp_path)], tmp_path, timeout=600))
    for refused in report.pop("prompt_tuning"):  # on every process, at prepare, saying why
        assert refused.startswith("ConfigurationError") and "virtual tokens" in refused, refused
    refused = report.pop("several_stages")  # a schedule with several stages per process: one line, the fix
    assert refused.startswith("ConfigurationError") and "one stage per process only" in refused, refused
    assert "pp_schedule='1F1B'" in refused, refused
    assert sorted(report) == ["tied=False pp=2", "tied=False pp=2 fsdp=2", "tied=False pp=3", "tied=True pp=2"]
    for case, seen in report.items():
        assert seen["grad_names_equal"] and seen["trainable_only_lora"], case
        assert seen["lora_grad_diff"] <= 1e-6, case
        assert seen["loss_diff"] <= 1e-6, case  # two training steps and an evaluation, on every stage
        assert seen["trained_moved"] > 1e-3 and seen["trained_diff"] <= 1e-6, case  # 2 AdamW steps
        assert seen["frozen_diff"] == 0.0, case
        assert seen["full_keys_equal"] and seen["full_diff"] <= 1e-6, case
        assert seen["adapter_keys_equal"] and seen["adapter_diff"] <= 1e-6, case
        # without a state_dict: the main process of unsharded stages writes every stage's adapter (it reads the
        # other stages' state itself); elsewhere one stage's adapter would be written as the model's: refused
        sharded = "fsdp" in case
        assert seen["save_pretrained_refused"] == ["ConfigurationError" if sharded else ""] + [
            "ConfigurationError"] * (len(seen["save_pretrained_refused"]) - 1), case
        if not sharded:
            assert seen["alone_adapter_keys_equal"] and seen["alone_adapter_diff"] <= 1e-6, case


PP_CONFIG = ("distributed_type: MULTI_CPU\nuse_cpu: true\nnum_processes: 2\nmixed_precision: 'no'\n"
             "parallelism_config:\n  parallelism_config_pp_size: 2\n  parallelism_config_pp_microbatches: 2\n")


def _one_and_pp(tmp_path, *argv):
    """``pp_trainer.py ARGV`` on one process and under ``hasten launch`` with pp_size=2 from the launch config."""
    script = [str(SCRIPTS / "pp_trainer.py"), *argv]
    (tmp_path / "one").mkdir()
    (tmp_path / "pp").mkdir()
    config = tmp_path / "pp.yaml"
    config.write_text(PP_CONFIG)
    one = _result(run([hf_python(), *script, "--alias"], tmp_path / "one"))
    pp = _result(hasten_launch(tmp_path / "pp", "--config_file", str(config), *script))
    assert (one["processes"], one["pp_size"], pp["processes"], pp["pp_size"]) == (1, 1, 2, 2)
    return one, pp


def _same_evaluation(one, pp):
    """Every metric of ``evaluate()`` but the timings within 1e-5 (TRL's entropy, token accuracy, tokens too)."""
    metrics = {key for key in one["eval"] if not key.endswith(("_runtime", "_per_second"))}
    assert metrics == {key for key in pp["eval"] if not key.endswith(("_runtime", "_per_second"))}
    for key in metrics:
        assert pp["eval"][key] == pytest.approx(one["eval"][key], rel=1e-5, abs=1e-6), key
    return metrics


@pytest.mark.parametrize("trainer, extra", [("trainer", ["--accumulation", "2", "--tied"]), ("sft", [])])
def test_trainer_and_sft_trainer_with_lora_under_pp_size_2_equal_pp_size_1(tmp_path, trainer, extra):
    """Trainer on ``get_peft_model(llama)`` (accumulation 2, tied frozen embeddings) and SFTTrainer(peft_config=...)
    with pp_size=2 from the launch config: the logged losses, the evaluation's metrics, the trained weights and the
    adapter that ``save_pretrained(path, state_dict=accelerator.get_state_dict(model))`` writes (PEFT's names)
    within 1e-5 of one process; the frozen base weights untouched."""
    import torch
    from safetensors.torch import load_file

    one, pp = _one_and_pp(tmp_path, "--trainer", trainer, "--lora", *extra)
    assert sorted(pp["losses"]) == sorted(one["losses"]) == ["1", "2", "3"]
    for step, loss in one["losses"].items():
        assert pp["losses"][step] == pytest.approx(loss, rel=1e-5, abs=1e-5), step
    metrics = _same_evaluation(one, pp)
    if trainer == "sft":
        assert {"eval_loss", "eval_entropy", "eval_mean_token_accuracy"} <= metrics
    assert pp["frozen"] == one["frozen"] > 30 and pp["frozen_moved"] == one["frozen_moved"] == 0.0
    want, got = torch.load(tmp_path / "one" / "weights.pt"), torch.load(tmp_path / "pp" / "weights.pt")
    assert sorted(got) == sorted(want) and any("lora_A" in name for name in want)
    for name, weight in want.items():
        assert torch.allclose(got[name], weight, rtol=0, atol=1e-5), name
    adapter, want_adapter = (load_file(tmp_path / run_ / "adapter" / "adapter_model.safetensors")
                             for run_ in ("pp", "one"))
    assert sorted(adapter) == sorted(want_adapter) and len(want_adapter) == 4 * 3 * 2  # layers x modules x A, B
    for name, weight in want_adapter.items():
        assert torch.allclose(adapter[name], weight, rtol=0, atol=1e-5), name
