"""``cv_example.py`` plus checkpointing, resuming (also from the middle of an epoch) and experiment tracking.

What it adds to the ResNet-on-digits example:

* ``--checkpointing_steps N`` saves the whole training state every N optimizer steps (``step_{N}``
  folders), ``--checkpointing_steps epoch`` after every epoch (``epoch_{e}`` folders), under
  ``--output_dir``.
* ``--resume_from_checkpoint FOLDER`` continues exactly where that checkpoint stopped. hasten's
  ``load_state`` restores the data loader's position too, so the loop simply iterates the loader:
  the first epoch after a mid-epoch checkpoint yields only the batches that were left. The epoch and
  step counters travel in the checkpoint as a registered object (``register_for_checkpointing``).
  (``complete_nlp_example.py`` shows the Accelerate-style alternative with ``skip_first_batches``.)
* ``--with_tracking`` logs accuracy, loss and epoch to the trackers of ``--report_to`` (default: the
  dependency-free JSON-lines tracker) under ``--project_dir``.

    python examples/complete_cv_example.py --checkpointing_steps 20 --output_dir ckpt
    python examples/complete_cv_example.py --resume_from_checkpoint ckpt/step_40
    hasten launch --num_processes 2 examples/complete_cv_example.py --with_tracking --project_dir runs
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from cv_example import ResNet, get_dataloaders

from hasten import Accelerator
from hasten.utils import set_seed


@dataclass
class Progress:
    """Where training stands; saved and restored with the checkpoint because it has state_dict/load_state_dict."""

    epoch: int = 0
    step: int = 0  # optimizer steps so far, over all epochs

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.step = state["epoch"], state["step"]


def evaluate(accelerator: Accelerator, model: torch.nn.Module, eval_loader) -> float:
    model.eval()
    correct = total = 0
    for images, labels in eval_loader:
        with torch.no_grad():
            predictions = model(images).argmax(dim=-1)
        predictions, labels = accelerator.gather_for_metrics((predictions, labels))
        correct += int((predictions == labels).sum())
        total += labels.numel()
    return correct / total


def training_function(config: dict, args: argparse.Namespace) -> float:
    checkpointing_steps = parse_checkpointing_steps(args.checkpointing_steps)
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision,
                              log_with=args.report_to if args.with_tracking else None, project_dir=args.project_dir)
    if args.with_tracking:
        # The run's name is this script's file name; its hyperparameters are stored with it.
        accelerator.init_trackers(os.path.splitext(os.path.basename(__file__))[0], config)

    set_seed(config["seed"])
    train_loader, eval_loader = get_dataloaders(config["batch_size"], args.max_train_samples, args.max_eval_samples)
    model = ResNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=1e-4)
    # As in Accelerate, the schedule is sized with the whole data set's number of batches: once prepared,
    # the scheduler advances once per process at every optimizer step.
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=config["lr"], epochs=config["num_epochs"],
                                                    steps_per_epoch=len(train_loader))
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler)

    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if args.resume_from_checkpoint:
        # Restores weights, optimizer, scheduler, random generators, `progress` and the loaders' positions.
        accelerator.load_state(args.resume_from_checkpoint)
        accelerator.print(f"Resumed from {args.resume_from_checkpoint}: epoch {progress.epoch}, step {progress.step}")

    accuracy = 0.0
    for epoch in range(progress.epoch, config["num_epochs"]):
        model.train()
        total_loss = torch.zeros((), device=accelerator.device)
        for images, labels in train_loader:  # after a mid-epoch resume: only the batches that were left
            loss = F.cross_entropy(model(images), labels)
            total_loss += loss.detach()
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            progress.step += 1
            if isinstance(checkpointing_steps, int) and progress.step % checkpointing_steps == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{progress.step}"))  # on every process

        progress.epoch = epoch + 1  # the epoch is done: a checkpoint from now on resumes at the next one
        accuracy = evaluate(accelerator, model, eval_loader)
        # The mean over processes of the summed batch losses (a collective: every process calls it).
        train_loss = accelerator.reduce(total_loss, reduction="mean").item()
        accelerator.print(f"epoch {epoch}: accuracy {accuracy:.4f} train_loss {train_loss:.6f}")
        if args.with_tracking:
            accelerator.log({"accuracy": accuracy, "train_loss": train_loss, "epoch": epoch}, step=progress.step)
        if checkpointing_steps == "epoch":
            accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))
    accelerator.end_training()
    return accuracy


def parse_checkpointing_steps(value: str | None) -> int | str | None:
    if value is None or value == "epoch":
        return value
    if not value.isdigit() or int(value) < 1:
        raise SystemExit(f"error: --checkpointing_steps {value!r}: use a positive number of steps or 'epoch'.")
    return int(value)


def main() -> None:
    parser = argparse.ArgumentParser(description="ResNet on digits with checkpointing, resuming and tracking.")
    parser.add_argument("--mixed_precision", type=str, default=None, choices=["no", "fp16", "bf16"],
                        help="Mixed precision (default: the launch configuration's, else 'no').")
    parser.add_argument("--cpu", action="store_true", help="Train on the CPU even if a GPU is available.")
    parser.add_argument("--checkpointing_steps", type=str, default=None,
                        help="Save the state every N optimizer steps, or 'epoch' after every epoch.")
    parser.add_argument("--resume_from_checkpoint", type=str, default=None, help="A checkpoint folder to resume from.")
    parser.add_argument("--output_dir", type=str, default=".", help="Where checkpoint folders are written.")
    parser.add_argument("--with_tracking", action="store_true", help="Log metrics to experiment trackers.")
    parser.add_argument("--report_to", type=str, default="jsonl",
                        help="Trackers for --with_tracking: jsonl (no extra package), tensorboard, mlflow, wandb, "
                             "or 'all' (every installed one).")
    parser.add_argument("--project_dir", type=str, default="logs", help="Where trackers write their logs.")
    parser.add_argument("--num_epochs", type=int, default=5)
    parser.add_argument("--batch_size", type=int, default=32, help="Per process.")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--max_train_samples", type=int, default=None, help="Use only the first N training images.")
    parser.add_argument("--max_eval_samples", type=int, default=None, help="Use only the first N held-out images.")
    args = parser.parse_args()
    if args.resume_from_checkpoint and not os.path.isdir(args.resume_from_checkpoint):
        raise SystemExit(f"error: --resume_from_checkpoint {args.resume_from_checkpoint}: no such folder.")
    config = {"lr": args.lr, "num_epochs": args.num_epochs, "seed": args.seed, "batch_size": args.batch_size}
    training_function(config, args)


if __name__ == "__main__":
    main()
