"""PEFT LoRA (with resume), TRL's SFTTrainer (plain, LoRA, packing), DPO/GRPO imports and ``device_map="auto"``
with disk offload, on one process, with hasten installed as accelerate. Prints ``OK <section>`` per section."""

import json
import sys

import hasten

hasten.install_as_accelerate()

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
)

WORDS = "the a cat dog sat ran on under mat log big small red blue".split()


def tokenizer():
    vocab = {"[PAD]": 0, "[UNK]": 1, "[BOS]": 2, "[EOS]": 3, **{w: i + 4 for i, w in enumerate(WORDS)}}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="[PAD]", unk_token="[UNK]", bos_token="[BOS]",
                                   eos_token="[EOS]")


def llama(seed=0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=len(WORDS) + 4, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                        max_position_embeddings=64, pad_token_id=0, bos_token_id=2, eos_token_id=3))


def sentences(n=24, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (6,), generator=generator).tolist())
            for _ in range(n)]


def lm_dataset(tok):
    encoded = tok(sentences(), padding="max_length", max_length=8, truncation=True, return_tensors="pt")
    return [{"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}
            for ids, mask in zip(encoded["input_ids"], encoded["attention_mask"])]


def lora_with_resume(tok, folder):
    from peft import LoraConfig, get_peft_model

    def build():
        model = get_peft_model(llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                   lora_dropout=0.0))
        args = TrainingArguments(output_dir=folder, per_device_train_batch_size=4, max_steps=4, save_steps=2,
                                 logging_steps=1, learning_rate=1e-2, report_to=[], seed=3, disable_tqdm=True)
        return Trainer(model=model, args=args, train_dataset=lm_dataset(tok))

    first = build()
    first.train()
    resumed = build()
    resumed.train(resume_from_checkpoint=f"{folder}/checkpoint-2")
    trainable = [n for n, p in first.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable), trainable
    a, b = first.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed LoRA weights differ from the uninterrupted run"
    assert any(a[k].abs().sum() > 0 for k in a if "lora_B" in k), "LoRA's B matrices (zero at start) never moved"
    print("OK lora_resume", flush=True)


def sft(tok, folder):
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    data = Dataset.from_dict({"text": sentences(32)})
    for name, extra, peft_config in (("plain", {}, None), ("packing", {"packing": True}, None),
                                     ("lora", {}, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))):
        config = SFTConfig(output_dir=f"{folder}/{name}", per_device_train_batch_size=4, max_steps=3, logging_steps=1,
                           report_to=[], max_length=16, save_strategy="no", disable_tqdm=True, bf16=False, **extra)
        trainer = SFTTrainer(model=llama(), args=config, train_dataset=data, processing_class=tok,
                             peft_config=peft_config)
        result = trainer.train()
        assert trainer.state.global_step == 3 and result.training_loss > 0
        print(f"OK sft_{name}", flush=True)


def dpo_grpo_import():
    from trl import DPOTrainer, GRPOTrainer  # noqa: F401

    print("OK dpo_grpo_import", flush=True)


def disk_offload(folder):
    model = llama(1).eval()
    model.save_pretrained(f"{folder}/saved")
    budget = {"cpu": "60KB"}
    offloaded = AutoModelForCausalLM.from_pretrained(f"{folder}/saved", device_map="auto", max_memory=budget,
                                                     offload_folder=f"{folder}/offload").eval()
    assert budget == {"cpu": 60_000}, budget  # converted in place, as transformers expects
    placed = set(offloaded.hf_device_map.values())
    assert "disk" in placed, offloaded.hf_device_map
    ids = torch.tensor([[2, 5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, offloaded(ids).logits, atol=1e-5)
    print("OK disk_offload " + json.dumps(sorted(map(str, placed))), flush=True)


if __name__ == "__main__":
    folder = sys.argv[1]
    tok = tokenizer()
    lora_with_resume(tok, f"{folder}/lora")
    sft(tok, f"{folder}/sft")
    dpo_grpo_import()
    disk_offload(folder)
