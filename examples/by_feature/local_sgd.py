"""Local SGD: each process takes several optimizer steps on its own, then the processes average their models.

Plain data-parallel training all-reduces the gradients at every step. With
``LocalSGD(accelerator=..., model=..., local_sgd_steps=K)`` the processes skip that and instead average
their parameters once every K optimizer steps, K times less communication, at some cost in accuracy
on hard problems. Call ``local_sgd.step()`` after each optimizer step; leaving the ``with`` block
averages one last time. With one process it changes nothing.

    python examples/by_feature/local_sgd.py
    hasten launch --num_processes 2 examples/by_feature/local_sgd.py --local_sgd_steps 8
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator
from hasten.local_sgd import LocalSGD
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default=None)
    parser.add_argument("--cpu", action="store_true", help="Train on the CPU even if a GPU is available.")
    parser.add_argument("--local_sgd_steps", type=int, default=8, help="Optimizer steps between two averagings.")
    parser.add_argument("--num_epochs", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=32, help="Per process.")
    args = parser.parse_args()

    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    set_seed(42)
    train_loader, eval_loader = get_dataloaders(args.batch_size)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)

    for epoch in range(args.num_epochs):
        model.train()
        with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=args.local_sgd_steps) as local_sgd:
            for x, y in train_loader:
                with accelerator.accumulate(model):
                    accelerator.backward(F.cross_entropy(model(x), y))
                    optimizer.step()
                    optimizer.zero_grad()
                    local_sgd.step()  # averages the models every local_sgd_steps calls

        model.eval()
        correct = total = 0
        for x, y in eval_loader:
            with torch.no_grad():
                predictions = model(x).argmax(dim=-1)
            predictions, y = accelerator.gather_for_metrics((predictions, y))
            correct += int((predictions == y).sum())
            total += y.numel()
        accelerator.print(f"epoch {epoch}: accuracy {correct / total:.4f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
