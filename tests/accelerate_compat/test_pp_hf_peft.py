"""Pipeline parallelism with the Hugging Face stack beyond a bare transformers model: a PEFT (LoRA) wrapper in the
ordinary loop, in Trainer and in SFTTrainer(peft_config=...), and SFTTrainer's evaluation, each against the same
script on one process. Like test_hf_stack.py, each test runs a script with the Hugging Face interpreter."""

import json
from pathlib import Path

import pytest

from helpers.hf_stack import hf_python, run

pytestmark = pytest.mark.launch

SCRIPTS = Path(__file__).resolve().parent / "hf_scripts"


def _result(out):
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, out[-3000:]
    return json.loads(lines[0][len("RESULT "):])


def test_lora_model_in_the_ordinary_loop_under_pp_equals_one_process(tmp_path):
    """``get_peft_model(llama)`` under pp_size 2 (untied and tied embeddings) and 3 (split points under the
    transformers model's names): cut by the base model's plan under the wrapper's names, the LoRA gradients within
    1e-6 of one process, the frozen base weights untouched, and ``get_state_dict``/``save_model`` (full weights)
    and ``save_pretrained(state_dict=...)`` (the adapter, every stage's) under PEFT's names as without PP."""
    report = _result(run([hf_python(), str(SCRIPTS / "pp_peft_loop.py"), str(tmp_path)], tmp_path, timeout=600))
    assert sorted(report) == ["tied=False pp=2", "tied=False pp=3", "tied=True pp=2"]
    for case, seen in report.items():
        assert seen["grad_names_equal"] and seen["trainable_only_lora"], case
        assert seen["lora_grad_diff"] <= 1e-6, case
        assert seen["loss_diff"] <= 1e-6, case  # two training steps and an evaluation, on every stage
        assert seen["trained_moved"] > 1e-3 and seen["trained_diff"] <= 1e-6, case  # 2 AdamW steps
        assert seen["frozen_diff"] == 0.0, case
        assert seen["full_keys_equal"] and seen["full_diff"] <= 1e-6, case
        assert seen["adapter_keys_equal"] and seen["adapter_diff"] <= 1e-6, case
        # without a state_dict, one stage's adapter would be written as the model's: refused on every stage
        assert set(seen["save_pretrained_refused"]) == {"ConfigurationError"}, case
