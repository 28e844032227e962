"""Find the largest batch size that fits in memory with ``find_executable_batch_size``.

The decorated function receives the batch size as its first argument. When it fails with an
out-of-memory error the decorator frees memory and calls it again with a smaller batch (90% of the
last one by default), so put everything that depends on the batch size (data loaders, prepare)
inside it, and free the previous attempt's objects with ``accelerator.free_memory()``.

A CPU seldom runs out of memory on this tiny model, so ``--simulated_memory`` (a number of samples)
makes the model raise ``torch.OutOfMemoryError`` for larger batches, to show the search.

    python examples/by_feature/memory.py --starting_batch_size 512 --simulated_memory 200
    hasten launch --num_processes 2 examples/by_feature/memory.py
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator, find_executable_batch_size
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


class MemoryHungryNet(nn.Module):
    """An MLP that pretends to run out of memory on batches larger than ``max_batch`` (0: never)."""

    def __init__(self, max_batch: int = 0) -> None:
        super().__init__()
        self.max_batch = max_batch
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.max_batch and x.shape[0] > self.max_batch:
            raise torch.OutOfMemoryError(f"simulated: a batch of {x.shape[0]} does not fit")
        return self.net(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default=None)
    parser.add_argument("--cpu", action="store_true", help="Train on the CPU even if a GPU is available.")
    parser.add_argument("--starting_batch_size", type=int, default=256, help="Per process.")
    parser.add_argument("--simulated_memory", type=int, default=100,
                        help="Largest batch (per process) the model accepts; 0 turns the simulation off.")
    parser.add_argument("--num_epochs", type=int, default=3)
    args = parser.parse_args()

    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)

    @find_executable_batch_size(starting_batch_size=args.starting_batch_size)
    def inner_training_loop(batch_size: int) -> None:
        accelerator.free_memory()  # drop what the failed attempt had prepared
        accelerator.print(f"trying batch size {batch_size}")
        set_seed(42)
        train_loader, eval_loader = get_dataloaders(batch_size)
        model = MemoryHungryNet(args.simulated_memory)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
        for epoch in range(args.num_epochs):
            model.train()
            for x, y in train_loader:
                accelerator.backward(F.cross_entropy(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
            model.eval()
            correct = total = 0
            for x, y in eval_loader:
                with torch.no_grad():
                    predictions = model(x).argmax(dim=-1)
                predictions, y = accelerator.gather_for_metrics((predictions, y))
                correct += int((predictions == y).sum())
                total += y.numel()
            accelerator.print(f"epoch {epoch}: accuracy {correct / total:.4f} with batch size {batch_size}")

    inner_training_loop()  # no argument: the decorator supplies the batch size
    accelerator.end_training()


if __name__ == "__main__":
    main()
