"""A tiny Transformers Trainer run (BERT classifier built from a config, synthetic data, no hub).

Train 6 optimizer steps with a checkpoint at step 3 (mid-epoch), evaluate, predict, save; then resume a new
Trainer from the checkpoint and finish. Rank 0 prints one ``RESULT {json}`` line: the logged losses of both
runs, the evaluation loss, the prediction shape and whether the resumed weights equal the uninterrupted ones.

Runs unchanged under ``hasten launch``, ``accelerate launch`` and plain ``python`` (``--alias`` installs
hasten as accelerate first, for plain python without Accelerate installed).
"""

import argparse
import json
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--alias", action="store_true")
parser.add_argument("--dropout", type=float, default=0.0)
parser.add_argument("--state_dict_types", default="", help="FSDP: comma-separated state-dict types to run")
parser.add_argument("--output_dir", default="out")
parser.add_argument("--no_resume", action="store_true")
options = parser.parse_args()
if options.alias:
    import hasten

    hasten.install_as_accelerate()

import torch  # noqa: E402
from transformers import (  # noqa: E402
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)


def dataset(n=96, length=8, vocab=64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (n, length), generator=generator)
    labels = (ids[:, 0] > vocab // 2).long()
    return [{"input_ids": ids[i], "attention_mask": torch.ones(length, dtype=torch.long), "labels": labels[i]}
            for i in range(n)]


def model(dropout):
    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=16, num_labels=2,
                        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return BertForSequenceClassification(config)


class Losses(TrainerCallback):
    def __init__(self):
        self.losses = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = float(logs["loss"])


def trainer_for(output_dir, state_dict_type=None):
    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=4, per_device_eval_batch_size=5,
                             gradient_accumulation_steps=2, max_steps=6, save_steps=3, logging_steps=1,
                             learning_rate=1e-3, seed=7, report_to=[], save_strategy="steps",
                             dataloader_drop_last=False, disable_tqdm=True)
    losses = Losses()
    trainer = Trainer(model=model(options.dropout), args=args, train_dataset=dataset(), eval_dataset=dataset(22, seed=1),
                      callbacks=[losses])
    if state_dict_type:
        trainer.accelerator.state.fsdp_plugin.set_state_dict_type(state_dict_type)
    return trainer, losses


def full_state(trainer):
    return {k: v.detach().float().cpu().clone() for k, v in trainer.accelerator.get_state_dict(trainer.model).items()}


def run(output_dir, state_dict_type=None):
    trainer, losses = trainer_for(output_dir, state_dict_type)
    trainer.train()
    weights = full_state(trainer)
    result = {"losses": losses.losses, "eval_loss": trainer.evaluate()["eval_loss"],
              "prediction_shape": list(trainer.predict(dataset(22, seed=1)).predictions.shape),
              "processes": trainer.accelerator.num_processes,
              "mixed_precision": trainer.accelerator.mixed_precision}
    trainer.save_model(f"{output_dir}/final")
    if not options.no_resume:
        resumed, resumed_losses = trainer_for(output_dir, state_dict_type)
        resumed.train(resume_from_checkpoint=f"{output_dir}/checkpoint-3")
        other = full_state(resumed)
        result["resumed_losses"] = resumed_losses.losses
        result["resume_equal"] = bool(trainer.accelerator.is_main_process and set(weights) == set(other) and
                                      all(torch.equal(weights[k], other[k]) for k in weights))
    return trainer, result


results = {}
for kind in (options.state_dict_types.split(",") if options.state_dict_types else [None]):
    trainer, results[kind or "default"] = run(f"{options.output_dir}/{kind or 'default'}", kind)
if trainer.accelerator.is_main_process:
    print("RESULT " + json.dumps(results), flush=True)
sys.stdout.flush()
