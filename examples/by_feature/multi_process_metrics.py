"""Exact metrics over several processes with ``gather_for_metrics``.

Each process evaluates its own share of the evaluation set. When the set does not divide evenly,
the prepared loader repeats a few samples at the end so that every process gets the same number of
batches; ``accelerator.gather_for_metrics`` gathers every process's predictions **and drops those
repeats**, so the metric covers each sample exactly once. Plain ``accelerator.gather`` keeps them:
this script prints both counts (359 held-out images on 2 processes: 384 gathered, 359 counted).

    python examples/by_feature/multi_process_metrics.py
    hasten launch --num_processes 2 examples/by_feature/multi_process_metrics.py
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator
from hasten.utils import set_seed


def get_dataloaders(batch_size: int, num_eval: int) -> tuple[DataLoader, DataLoader]:
    """scikit-learn's 8x8 digits as 64-feature vectors; the first ``num_eval`` (of a fixed shuffle) are held out."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = torch.randperm(len(digits.target), generator=torch.Generator().manual_seed(0))
    x = torch.tensor(digits.data, dtype=torch.float32)[order] / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)[order]
    train = DataLoader(TensorDataset(x[num_eval:], y[num_eval:]), batch_size=batch_size, shuffle=True)
    return train, DataLoader(TensorDataset(x[:num_eval], y[:num_eval]), batch_size=64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default=None)
    parser.add_argument("--cpu", action="store_true", help="Train on the CPU even if a GPU is available.")
    parser.add_argument("--num_eval", type=int, default=359, help="Held-out images (an odd number on purpose).")
    parser.add_argument("--num_epochs", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=32, help="Per process.")
    args = parser.parse_args()

    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    set_seed(42)
    train_loader, eval_loader = get_dataloaders(args.batch_size, args.num_eval)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)

    for epoch in range(args.num_epochs):
        model.train()
        for x, y in train_loader:
            accelerator.backward(F.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()

        model.eval()
        correct = counted = gathered = 0
        for x, y in eval_loader:
            with torch.no_grad():
                predictions = model(x).argmax(dim=-1)
            gathered += accelerator.gather(y).numel()  # includes the repeated samples of the last batch
            predictions, y = accelerator.gather_for_metrics((predictions, y))  # each sample exactly once
            correct += int((predictions == y).sum())
            counted += y.numel()
        accelerator.print(f"epoch {epoch}: accuracy {correct / counted:.4f} over {counted} samples "
                          f"(gather alone returned {gathered}; the data set has {len(eval_loader.dataset)})")
    accelerator.end_training()


if __name__ == "__main__":
    main()
