"""``nlp_example.py`` plus checkpointing, resuming (also from the middle of an epoch) and experiment tracking.

Written the way Accelerate's ``complete_nlp_example.py`` is, so an Accelerate script ports unchanged:

* ``--checkpointing_steps N`` saves the whole state every N steps into ``{output_dir}/step_{N}``;
  ``--checkpointing_steps epoch`` into ``{output_dir}/epoch_{e}`` after each epoch.
* ``--resume_from_checkpoint FOLDER`` loads the state and reads from the folder's name where to start;
  the interrupted epoch skips the batches already seen with ``accelerator.skip_first_batches``.
  (With hasten, ``load_state`` alone already puts the loader back at its saved position, see
  ``complete_cv_example.py``; ``skip_first_batches`` then sets the same position again, it does not add
  to it, so this Accelerate-style code resumes correctly too.)
* ``--with_tracking`` logs accuracy, F1, loss and epoch to the trackers of ``--report_to`` under
  ``--project_dir``.

    python examples/complete_nlp_example.py --train_file train.csv --validation_file dev.csv --checkpointing_steps 10
    python examples/complete_nlp_example.py --train_file train.csv --validation_file dev.csv \\
        --resume_from_checkpoint step_10 --with_tracking --report_to jsonl --project_dir runs
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from nlp_example import accuracy_and_f1, build_parser, get_dataloaders, load_inputs

from hasten import Accelerator
from hasten.utils import set_seed


def evaluate(accelerator: Accelerator, model: torch.nn.Module, eval_loader) -> dict:
    model.eval()
    all_predictions, all_references = [], []
    for batch in eval_loader:
        with torch.no_grad():
            predictions = model(**batch).logits.argmax(dim=-1)
        predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
        all_predictions.append(predictions.cpu())
        all_references.append(references.cpu())
    return accuracy_and_f1(torch.cat(all_predictions), torch.cat(all_references))


def resume_position(checkpoint: str, steps_per_epoch: int) -> tuple[int, int | None]:
    """(first epoch, batches to skip in it) from a checkpoint folder named ``epoch_{e}`` or ``step_{n}``."""
    name = os.path.basename(os.path.normpath(checkpoint))
    if name.startswith("epoch_"):
        return int(name[len("epoch_"):]) + 1, None
    overall_step = int(name[len("step_"):])
    return overall_step // steps_per_epoch, overall_step % steps_per_epoch


def training_function(config: dict, args: argparse.Namespace, train_rows: list[dict], eval_rows: list[dict]) -> dict:
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        get_linear_schedule_with_warmup,
    )
    from transformers.utils import logging as hf_logging

    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision,
                              log_with=args.report_to if args.with_tracking else None, project_dir=args.project_dir)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if args.with_tracking:
        accelerator.init_trackers(os.path.splitext(os.path.basename(__file__))[0], config)

    set_seed(config["seed"])
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    train_loader, eval_loader = get_dataloaders(accelerator, tokenizer, train_rows, eval_rows,
                                                config["batch_size"], args.eval_batch_size)
    model = AutoModelForSequenceClassification.from_pretrained(args.model_name_or_path, num_labels=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    # Sized with the whole data set's number of batches, as in Accelerate: once prepared, the scheduler
    # advances once per process at every optimizer step.
    total_steps = len(train_loader) * config["num_epochs"]
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=total_steps // 10,
                                                num_training_steps=total_steps)
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler)

    overall_step, starting_epoch, resume_step = 0, 0, None
    if args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)
        starting_epoch, resume_step = resume_position(args.resume_from_checkpoint, len(train_loader))
        overall_step = starting_epoch * len(train_loader)
        accelerator.print(f"Resumed from {args.resume_from_checkpoint}: epoch {starting_epoch}, batch {resume_step or 0}")

    metrics: dict = {}
    for epoch in range(starting_epoch, config["num_epochs"]):
        model.train()
        total_loss = torch.zeros((), device=accelerator.device)
        active_loader = train_loader
        if resume_step is not None and epoch == starting_epoch:
            # Skip the batches of this epoch that the checkpointed run had already trained on.
            active_loader = accelerator.skip_first_batches(train_loader, resume_step)
            overall_step += resume_step
        for batch in active_loader:
            outputs = model(**batch)
            total_loss += outputs.loss.detach()
            accelerator.backward(outputs.loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            overall_step += 1
            if isinstance(args.checkpointing_steps, int) and overall_step % args.checkpointing_steps == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{overall_step}"))  # on every process

        metrics = evaluate(accelerator, model, eval_loader)
        train_loss = accelerator.reduce(total_loss, reduction="mean").item()  # a collective: all processes call it
        accelerator.print(f"epoch {epoch}: accuracy {metrics['accuracy']:.4f} f1 {metrics['f1']:.4f} "
                          f"train_loss {train_loss:.6f}")
        if args.with_tracking:
            accelerator.log({**metrics, "train_loss": train_loss, "epoch": epoch}, step=overall_step)
        if args.checkpointing_steps == "epoch":
            accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))
    accelerator.end_training()
    return metrics


def main() -> None:
    parser = build_parser()  # nlp_example's arguments, plus:
    parser.add_argument("--checkpointing_steps", type=str, default=None,
                        help="Save the state every N steps, or 'epoch' after every epoch.")
    parser.add_argument("--resume_from_checkpoint", type=str, default=None,
                        help="A checkpoint folder (named step_N or epoch_E) to resume from.")
    parser.add_argument("--output_dir", type=str, default=".", help="Where checkpoint folders are written.")
    parser.add_argument("--with_tracking", action="store_true", help="Log metrics to experiment trackers.")
    parser.add_argument("--report_to", type=str, default="jsonl",
                        help="Trackers for --with_tracking: jsonl (no extra package), tensorboard, mlflow, wandb, "
                             "or 'all' (every installed one).")
    parser.add_argument("--project_dir", type=str, default="logs", help="Where trackers write their logs.")
    args = parser.parse_args()
    if args.checkpointing_steps not in (None, "epoch"):
        if not args.checkpointing_steps.isdigit() or int(args.checkpointing_steps) < 1:
            sys.exit(f"error: --checkpointing_steps {args.checkpointing_steps!r}: use a positive number or 'epoch'.")
        args.checkpointing_steps = int(args.checkpointing_steps)
    resume = args.resume_from_checkpoint
    if resume is not None:
        name = os.path.basename(os.path.normpath(resume))
        if not os.path.isdir(resume) or not (name.startswith("epoch_") or name.startswith("step_")):
            sys.exit(f"error: --resume_from_checkpoint {resume}: give an existing folder named step_N or epoch_E.")
    train_rows, eval_rows = load_inputs(args)
    config = {"lr": args.lr, "num_epochs": args.num_epochs, "seed": args.seed, "batch_size": args.batch_size}
    training_function(config, args, train_rows, eval_rows)


if __name__ == "__main__":
    main()
