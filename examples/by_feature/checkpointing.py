"""Checkpointing with automatic folder names: save the whole training state each epoch, resume from the newest.

``ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=2)`` makes ``save_state()`` write
``{project_dir}/checkpoints/checkpoint_{i}`` and keep only the two newest; ``load_state()`` without a
folder loads the newest complete one. A checkpoint holds the model, optimizer, scheduler, random
generators, data loader positions and every object given to ``register_for_checkpointing``.
Every process calls ``save_state`` and ``load_state``.

    python examples/by_feature/checkpointing.py --project_dir run --num_epochs 2
    python examples/by_feature/checkpointing.py --project_dir run --num_epochs 4 --resume   # epochs 2 and 3
    hasten launch --num_processes 2 examples/by_feature/checkpointing.py --project_dir run
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator, ProjectConfiguration
from hasten.utils import set_seed


def get_dataloaders(batch_size: int) -> tuple[DataLoader, DataLoader]:
    """scikit-learn's 8x8 digits as 64-feature vectors; a fixed fifth of them is held out."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = torch.randperm(len(digits.target), generator=torch.Generator().manual_seed(0))
    x = torch.tensor(digits.data, dtype=torch.float32)[order] / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)[order]
    train = DataLoader(TensorDataset(x[360:], y[360:]), batch_size=batch_size, shuffle=True)
    return train, DataLoader(TensorDataset(x[:360], y[:360]), batch_size=128)


class EpochCounter:
    """Any object with state_dict/load_state_dict can travel in the checkpoint."""

    def __init__(self) -> None:
        self.epochs_done = 0

    def state_dict(self) -> dict:
        return {"epochs_done": self.epochs_done}

    def load_state_dict(self, state: dict) -> None:
        self.epochs_done = state["epochs_done"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default=None)
    parser.add_argument("--cpu", action="store_true", help="Train on the CPU even if a GPU is available.")
    parser.add_argument("--project_dir", default="checkpointing_run", help="Checkpoints go to PROJECT_DIR/checkpoints.")
    parser.add_argument("--resume", action="store_true", help="Continue from the newest checkpoint.")
    parser.add_argument("--num_epochs", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=32, help="Per process.")
    args = parser.parse_args()

    project = ProjectConfiguration(project_dir=args.project_dir, automatic_checkpoint_naming=True, total_limit=2)
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision, project_config=project)
    set_seed(42)
    train_loader, eval_loader = get_dataloaders(args.batch_size)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    counter = EpochCounter()
    accelerator.register_for_checkpointing(counter)
    if args.resume:
        folder = accelerator.load_state()  # the newest checkpoint under project_dir/checkpoints
        accelerator.print(f"resumed from {folder} after {counter.epochs_done} epoch(s)")

    for epoch in range(counter.epochs_done, args.num_epochs):
        model.train()
        for x, y in train_loader:
            accelerator.backward(F.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        counter.epochs_done = epoch + 1
        folder = accelerator.save_state()  # checkpoint_0, checkpoint_1, ... (older ones beyond total_limit go)

        model.eval()
        correct = total = 0
        for x, y in eval_loader:
            with torch.no_grad():
                predictions = model(x).argmax(dim=-1)
            predictions, y = accelerator.gather_for_metrics((predictions, y))
            correct += int((predictions == y).sum())
            total += y.numel()
        accelerator.print(f"epoch {epoch}: accuracy {correct / total:.4f}, saved {folder}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
