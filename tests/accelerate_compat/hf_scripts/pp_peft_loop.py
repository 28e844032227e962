"""A PEFT LoRA model (``peft.get_peft_model`` on a tiny Llama from a config) in the ordinary loop under pp_size=2
and 3 and PP2 x FSDP2(2) (forked gloo ranks), against the same loop on one process. Prints one ``RESULT {json}`` line with the largest
differences: the LoRA weights' gradients, the trained weights, the frozen base weights (against their initial
values), the losses, and the full and adapter weights saved through ``accelerator.get_state_dict`` (PEFT's names).

A prompt-tuning model is refused at ``prepare`` (its reason is reported). Run with the Hugging Face interpreter: ``python pp_peft_loop.py FOLDER``.
"""

import json
import shutil
import sys
from pathlib import Path

import hasten

hasten.install_as_accelerate()

import torch  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from hasten.strategies.pipeline_nd import full_value  # noqa: E402
from hasten.testing import run_on_ranks  # noqa: E402

BATCH, SEQ, STEPS = 4, 6, 2


def lora_llama(tied: bool):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=tied, attn_implementation="eager")
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                                target_modules=["q_proj", "v_proj", "down_proj"],
                                                                task_type="CAUSAL_LM"))
    for name, param in model.named_parameters():  # LoRA's B starts at zero: give A's gradient something to reach
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    return model


def batches():
    """Left-padded batches whose padding differs per row (so the micro-batches hold different token counts)."""
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(1, 48, (BATCH, SEQ), generator=generator)
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        for row, pad in enumerate([0, 3, 1, 4]):
            mask[row, :pad] = 0
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def train(model, accelerator=None):
    """Two AdamW steps over the trainable weights with clipping; the first step's gradients, the losses and an
    evaluation loss."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=0.01)
    if accelerator is not None:
        model, optimizer = accelerator.prepare(model, optimizer)
    named = (accelerator.unwrap_model(model) if accelerator else model).named_parameters
    grads, losses = {}, []
    for step, batch in enumerate(batches()):
        outputs = model(**batch)
        (accelerator.backward(outputs.loss) if accelerator else outputs.loss.backward())
        if step == 0:
            grads = {name: full_value(p.grad).clone() for name, p in named() if p.grad is not None}  # FSDP2: gathered
        clip = accelerator.clip_grad_norm_ if accelerator else torch.nn.utils.clip_grad_norm_
        clip(model.parameters(), 0.05)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(outputs.loss.item())
    model.eval()
    with torch.no_grad():
        losses.append(model(**batches()[0]).loss.item())
    return model, grads, losses


def one_process(tied: bool, folder: Path):
    model = lora_llama(tied)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    model, grads, losses = train(model)
    model.save_pretrained(folder / "one")
    return initial, grads, losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def pipelined(tied: bool, folder: str, shard: int):
    from hasten import Accelerator, ParallelismConfig

    model = lora_llama(tied)
    stages = torch.distributed.get_world_size() // shard
    # 3 stages: split points under the transformers model's names (1, 2 and 1 layers)
    points = None if stages == 2 else ["model.layers.1", "model.layers.3"]
    # PP x FSDP2: both data-parallel ranks read the same batches, so their mean is one process's step
    config = ParallelismConfig(pp_size=stages, pp_microbatches=2 if stages == 2 else 4, pp_split_points=points,
                               dp_shard_size=shard)
    accelerator = Accelerator(parallelism_config=config, cpu=True)
    model, grads, losses = train(model, accelerator)
    stage = accelerator.unwrap_model(model)
    weights = {name: full_value(p.detach()).clone() for name, p in stage.named_parameters()}
    full = accelerator.get_state_dict(model)  # every process: it gathers the stages
    if accelerator.is_main_process:
        stage.save_pretrained(Path(folder) / "pp", state_dict=full)  # PEFT keeps the adapter's weights
    accelerator.save_model(model, Path(folder) / "pp_full")
    refused = ""
    try:  # the main process of unsharded stages reads the other stages' adapters itself (Trainer saves so)
        stage.save_pretrained(Path(folder) / "alone")
    except ValueError as error:  # elsewhere one stage's adapter is not the model's
        refused = type(error).__name__
    trainable = sorted(name for name, p in stage.named_parameters() if p.requires_grad)
    return grads, losses, weights, full, refused, trainable


def prompt_tuning_refused():
    """A prompt-learning method adds virtual tokens in the wrapper's forward: refused at prepare, with the reason."""
    from peft import PromptTuningConfig

    from hasten import Accelerator, ParallelismConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    model = get_peft_model(LlamaForCausalLM(config), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2))
    accelerator = Accelerator(parallelism_config=ParallelismConfig(pp_size=2, pp_microbatches=2), cpu=True)
    try:
        accelerator.prepare(model)
    except ValueError as error:
        return f"{type(error).__name__}: {error}"
    return "prepared"


def several_stages_refused():
    """A PEFT model is cut into one stage per process only: several (Interleaved1F1B's) are refused, saying why."""
    from hasten.strategies.pipeline_hf import cut_transformers_stages

    try:
        cut_transformers_stages(lora_llama(False), None, [0, 2], 4)
    except ValueError as error:
        return f"{type(error).__name__}: {error}"
    return "cut"


def largest(pairs):
    return max((float((a - b).abs().max()) for a, b in pairs), default=0.0)


def main():
    folder = Path(sys.argv[1])
    report = {}
    for tied, world, shard in [(False, 2, 1), (True, 2, 1), (False, 3, 1), (False, 4, 2)]:
        initial, want_grads, want_losses, want_state = one_process(tied, folder)
        shutil.rmtree(folder / "alone", ignore_errors=True)
        ranks = run_on_ranks(pipelined, world_size=world, args=(tied, str(folder), shard), timeout=240)
        grads = {name: grad for result in ranks for name, grad in result[0].items()}
        weights = {name: w for result in ranks for name, w in result[2].items()}
        full = ranks[0][3]
        adapter, want_adapter = (load_file(folder / sub / "adapter_model.safetensors") for sub in ("pp", "one"))
        saved = load_file(folder / "pp_full" / "model.safetensors")
        alone_file = folder / "alone" / "adapter_model.safetensors"
        alone = load_file(alone_file) if alone_file.exists() else {}
        lora = [name for name in want_grads if "lora_" in name]
        report[f"tied={tied} pp={world // shard}" + (f" fsdp={shard}" if shard > 1 else "")] = {
            "grad_names_equal": sorted(grads) == sorted(want_grads) and len(lora) == len(want_grads) > 0,
            "lora_grad_diff": largest((grads[n], want_grads[n]) for n in lora),
            "loss_diff": max(abs(a - b) / abs(b) for r in ranks for a, b in zip(r[1], want_losses)),
            "trained_diff": largest((weights[n], want_state[n]) for n in weights),
            "trained_moved": largest((weights[n], initial[n]) for n in lora),
            "frozen_diff": largest((w, initial[n]) for n, w in weights.items() if "lora_" not in n),
            "full_keys_equal": sorted(full) == sorted(want_state) and set(saved) <= set(want_state),
            "full_diff": largest([(full[n], want_state[n]) for n in want_state]
                                 + [(saved[n], want_state[n]) for n in saved]),
            "adapter_keys_equal": sorted(adapter) == sorted(want_adapter) and len(adapter) > 0,
            "adapter_diff": largest((adapter[n], want_adapter[n]) for n in want_adapter),
            "save_pretrained_refused": [r[4] for r in ranks],
            "alone_adapter_diff": largest((alone[n], want_adapter[n]) for n in want_adapter) if alone else None,
            "alone_adapter_keys_equal": sorted(alone) == sorted(want_adapter),
            "trainable_only_lora": all(all("lora_" in n for n in r[5]) for r in ranks),
        }
    report["prompt_tuning"] = run_on_ranks(prompt_tuning_refused, world_size=2, timeout=60)
    report["several_stages"] = several_stages_refused()
    print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
