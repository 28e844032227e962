"""Start multi-process training from Python (a Jupyter/Colab notebook, or a script) with ``notebook_launcher``.

``notebook_launcher(training_function, args, num_processes=N)`` forks N processes that each run
``training_function(*args)``; no ``hasten launch`` needed. In a notebook, put the imports and
the function in cells, then call the launcher in the last one. Rules that keep forking safe:
create the ``Accelerator`` (and touch the GPU) only *inside* the function, never in the notebook
itself; the launcher refuses, with the fix in its message, if a cell already did.

This script is its own launcher: run it with plain ``python``, not with ``hasten launch``.

    python examples/by_feature/notebook_launch.py --num_processes 2
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hasten import notebook_launcher


def get_dataloaders(batch_size: int) -> tuple[DataLoader, DataLoader]:
    """scikit-learn's 8x8 digits as 64-feature vectors; a fixed fifth of them is held out."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = torch.randperm(len(digits.target), generator=torch.Generator().manual_seed(0))
    x = torch.tensor(digits.data, dtype=torch.float32)[order] / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)[order]
    train = DataLoader(TensorDataset(x[360:], y[360:]), batch_size=batch_size, shuffle=True)
    return train, DataLoader(TensorDataset(x[:360], y[:360]), batch_size=128)


def training_function(num_epochs: int, batch_size: int, cpu: bool) -> None:
    """Runs in every launched process: everything distributed is created in here."""
    from hasten import Accelerator
    from hasten.utils import set_seed

    accelerator = Accelerator(cpu=cpu)  # mixed precision comes from notebook_launcher(mixed_precision=...)
    set_seed(42)
    train_loader, eval_loader = get_dataloaders(batch_size)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    for epoch in range(num_epochs):
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
        accelerator.print(f"epoch {epoch}: accuracy {correct / total:.4f} on {accelerator.num_processes} process(es)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default="no")
    parser.add_argument("--cpu", action="store_true", help="Train on the CPU even if a GPU is available.")
    parser.add_argument("--num_processes", type=int, default=2)
    parser.add_argument("--num_epochs", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=32, help="Per process.")
    args = parser.parse_args()
    # In a notebook this is the last cell: the function and its arguments, the number of processes.
    notebook_launcher(training_function, args=(args.num_epochs, args.batch_size, args.cpu),
                      num_processes=args.num_processes, mixed_precision=args.mixed_precision)


if __name__ == "__main__":
    main()
