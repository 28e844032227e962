"""Transformers' Trainer or TRL's SFTTrainer on a tiny Llama (from a config, synthetic text, no hub), unchanged
whatever the launch config's pipeline size. Rank 0 prints one ``RESULT {json}`` line with the logged losses (and
the evaluation's metrics) and writes the final full weights (``accelerator.get_state_dict``) to ``weights.pt``;
every process then calls ``accelerator.save_model`` into ``final/``. With ``--save_steps N`` Trainer checkpoints every
N steps (and at the end); ``--resume FOLDER`` resumes from such a checkpoint; ``--save_model FOLDER`` calls
``trainer.save_model(FOLDER)`` on every process after training (Trainer writes from the main process alone);
``--lora`` trains a PEFT LoRA adapter.

Run under ``hasten launch`` (a config with ``parallelism_config_pp_size``) or plain ``python --alias``.
"""

import argparse
import json

parser = argparse.ArgumentParser()
parser.add_argument("--alias", action="store_true")
parser.add_argument("--trainer", choices=["trainer", "sft"], default="trainer")
parser.add_argument("--accumulation", type=int, default=1)
parser.add_argument("--tied", action="store_true")
parser.add_argument("--save_steps", type=int, default=0)
parser.add_argument("--resume", default=None, help="a Trainer checkpoint folder to resume from")
parser.add_argument("--lora", action="store_true", help="train a PEFT LoRA adapter (Trainer: get_peft_model; SFT: "
                    "peft_config); rank 0 also writes the adapter with save_pretrained into adapter/")
parser.add_argument("--save_model", default=None, help="trainer.save_model(FOLDER) after training")
options = parser.parse_args()
if options.alias:
    import hasten

    hasten.install_as_accelerate()

import torch  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

WORDS = "the a cat dog sat ran on under mat log big small red blue".split()
STEPS = 3


def tokenizer():
    vocab = {"[PAD]": 0, "[UNK]": 1, "[BOS]": 2, "[EOS]": 3, **{w: i + 4 for i, w in enumerate(WORDS)}}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="[PAD]", unk_token="[UNK]", bos_token="[BOS]",
                                   eos_token="[EOS]")


def llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=len(WORDS) + 4, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
                                        max_position_embeddings=64, pad_token_id=0, bos_token_id=2, eos_token_id=3,
                                        tie_word_embeddings=options.tied))


def sentences(n=48, seed=0):
    """Sentences of 2..7 words: padded batches whose micro-batches hold different numbers of tokens."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 8, (n,), generator=generator).tolist()
    return [" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (k,), generator=generator).tolist())
            for k in lengths]


def lm_dataset(tok):
    encoded = tok(sentences(), padding="max_length", max_length=8, truncation=True, return_tensors="pt")
    return [{"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
            for ids, mask in zip(encoded["input_ids"], encoded["attention_mask"])]


class Losses(TrainerCallback):
    def __init__(self):
        self.losses = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = float(logs["loss"])


def main():
    tok = tokenizer()
    common = dict(output_dir="out", per_device_train_batch_size=4, gradient_accumulation_steps=options.accumulation,
                  max_steps=STEPS, logging_steps=1, learning_rate=1e-2, report_to=[], seed=0,
                  disable_tqdm=True, max_grad_norm=0.5,
                  **(dict(save_strategy="steps", save_steps=options.save_steps) if options.save_steps else
                     dict(save_strategy="no")))
    losses = Losses()
    lora = None
    if options.lora:
        from peft import LoraConfig

        lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"],
                          task_type="CAUSAL_LM")
    if options.trainer == "sft":
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        config = SFTConfig(max_length=8, bf16=False, per_device_eval_batch_size=8, **common)
        trainer = SFTTrainer(model=llama(), args=config, train_dataset=Dataset.from_dict({"text": sentences()}),
                             eval_dataset=Dataset.from_dict({"text": sentences(16, seed=1)}), processing_class=tok,
                             callbacks=[losses], peft_config=lora)
    else:
        data = lm_dataset(tok)
        model = llama()
        if lora is not None:
            from peft import get_peft_model

            model = get_peft_model(model, lora)
        trainer = Trainer(model=model, args=TrainingArguments(per_device_eval_batch_size=8, **common),
                          train_dataset=data, eval_dataset=data[:16], callbacks=[losses])
    frozen = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if not p.requires_grad}
    trainer.train(resume_from_checkpoint=options.resume)
    if options.save_model:
        trainer.save_model(options.save_model)
    evaluated = trainer.evaluate()
    accelerator = trainer.accelerator
    weights = accelerator.get_state_dict(trainer.model_wrapped)
    if accelerator.is_main_process:
        torch.save({k: v.detach().cpu() for k, v in weights.items()}, "weights.pt")
        if options.lora:  # PEFT picks the adapter's entries of the full weights
            accelerator.unwrap_model(trainer.model_wrapped).save_pretrained("adapter", state_dict=weights)
        parallelism = accelerator.parallelism_config
        print("RESULT " + json.dumps({"processes": accelerator.num_processes, "losses": losses.losses,
                                      "eval_loss": evaluated.get("eval_loss"), "eval": evaluated,
                                      "frozen_moved": max((float((weights[n] - w).abs().max()) for n, w in
                                                           frozen.items()), default=0.0), "frozen": len(frozen),
                                      "pp_size": getattr(parallelism, "pp_size", 1) or 1}), flush=True)
    accelerator.save_model(trainer.model_wrapped, "final")  # every process: it gathers the stages


main()
