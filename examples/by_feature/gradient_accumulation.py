"""Gradient accumulation: take an optimizer step every N batches, as if the batch were N times larger.

``Accelerator(gradient_accumulation_steps=N)`` plus ``with accelerator.accumulate(model):`` around the
step is all it takes: inside the block ``optimizer.step()``/``zero_grad()`` and the scheduler only act
on every N-th batch (and on the last batch of the epoch), ``accelerator.backward`` divides the loss by
N, and with several processes gradients are only all-reduced on the stepping batch (less communication).

    python examples/by_feature/gradient_accumulation.py --gradient_accumulation_steps 4
    hasten launch --num_processes 2 examples/by_feature/gradient_accumulation.py
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator
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
    parser.add_argument("--gradient_accumulation_steps", type=int, default=4)
    parser.add_argument("--batch_size", type=int, default=8, help="Micro-batch size per process.")
    parser.add_argument("--num_epochs", type=int, default=3)
    args = parser.parse_args()

    # New: the number of micro-batches per optimizer step is given to the Accelerator.
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=args.gradient_accumulation_steps)
    set_seed(42)
    train_loader, eval_loader = get_dataloaders(args.batch_size)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # The schedule counts optimizer steps (one per N micro-batches), over the whole data set.
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1,
                                                  total_iters=args.num_epochs * len(train_loader)
                                                  // args.gradient_accumulation_steps)
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler)

    optimizer_steps = 0
    for epoch in range(args.num_epochs):
        model.train()
        for x, y in train_loader:
            # New: everything of one step goes inside `accumulate`; the code itself is unchanged.
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()  # only really steps when accelerator.sync_gradients is True
                scheduler.step()
                optimizer.zero_grad()
            optimizer_steps += int(accelerator.sync_gradients)

        model.eval()
        correct = total = 0
        for x, y in eval_loader:
            with torch.no_grad():
                predictions = model(x).argmax(dim=-1)
            predictions, y = accelerator.gather_for_metrics((predictions, y))
            correct += int((predictions == y).sum())
            total += y.numel()
        accelerator.print(f"epoch {epoch}: accuracy {correct / total:.4f} "
                          f"({optimizer_steps} optimizer steps for {(epoch + 1) * len(train_loader)} micro-batches)")
    accelerator.end_training()


if __name__ == "__main__":
    main()
