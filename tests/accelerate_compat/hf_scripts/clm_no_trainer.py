"""The shape of transformers' ``run_clm_no_trainer.py`` / ``run_mlm_no_trainer.py`` (a tiny GPT-2 from a config,
synthetic token blocks, no hub), including their Accelerate-0.x name ``DistributedType.TPU``.

Rank 0 prints one ``RESULT {json}`` line: the process count, the losses, the evaluation perplexity, whether
``DistributedType.TPU`` warned, and whether the saved model loads back equal.
"""

import json
import math
import sys
import warnings

import torch
from accelerate import Accelerator, DistributedType
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel, default_data_collator, get_scheduler

logger = get_logger(__name__)


def blocks(n, length=16, vocab=96, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, length), generator=generator)
    return [{"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row.clone()} for row in ids]


def main(output_dir):
    accelerator = Accelerator(gradient_accumulation_steps=2)
    set_seed(0)
    config = GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    with accelerator.main_process_first():
        train, evaluation = blocks(32), blocks(10, seed=1)
    train_loader = DataLoader(train, shuffle=True, collate_fn=default_data_collator, batch_size=4)
    eval_loader = DataLoader(evaluation, collate_fn=default_data_collator, batch_size=4)
    decay = [p for n, p in model.named_parameters() if not any(k in n for k in ("bias", "ln_"))]
    rest = [p for n, p in model.named_parameters() if any(k in n for k in ("bias", "ln_"))]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                                  lr=5e-3)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=8)
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # the examples' line: on TPU the tied weights were disconnected, so tie them again
        if accelerator.distributed_type == DistributedType.TPU:
            model.tie_weights()
    losses = []
    for _ in range(2):
        model.train()
        for batch in train_loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            losses.append(accelerator.gather(loss.detach()).mean().item())
    model.eval()
    eval_losses = []
    for batch in eval_loader:
        with torch.no_grad():
            loss = model(**batch).loss
        eval_losses.append(accelerator.gather_for_metrics(loss.repeat(batch["input_ids"].shape[0])))
    eval_losses = torch.cat(eval_losses)
    perplexity = math.exp(torch.mean(eval_losses))
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(output_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        reloaded = GPT2LMHeadModel.from_pretrained(output_dir)
        same = all(torch.equal(a, b) for a, b in zip(unwrapped.state_dict().values(), reloaded.state_dict().values()))
        print("RESULT " + json.dumps({
            "processes": accelerator.num_processes, "losses": losses, "perplexity": perplexity,
            "evaluated": int(eval_losses.numel()), "reloaded_equal": same,
            "tpu_warned": any(issubclass(w.category, FutureWarning) and "DistributedType.TPU" in str(w.message)
                              for w in caught)}))
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "clm_out")
