"""Early stopping across processes with ``set_trigger`` / ``check_trigger``.

A condition seen by one process (here: the training loss fell below ``--loss_threshold``; each
process sees only its own batches) must stop **every** process at the same step, or the others
would wait forever in the next collective. ``accelerator.set_trigger()`` raises a flag on the
process that saw it; ``accelerator.check_trigger()``, called by every process, returns True on all
of them if any process raised it (and lowers the flag again).

    python examples/by_feature/early_stopping.py --loss_threshold 0.2
    hasten launch --num_processes 2 examples/by_feature/early_stopping.py
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
    parser.add_argument("--loss_threshold", type=float, default=0.1, help="Stop once a batch loss is below this.")
    parser.add_argument("--num_epochs", type=int, default=10)
    parser.add_argument("--batch_size", type=int, default=32, help="Per process.")
    args = parser.parse_args()

    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    set_seed(42)
    train_loader, eval_loader = get_dataloaders(args.batch_size)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)

    step, stopped_in_epoch = 0, None
    for epoch in range(args.num_epochs):
        model.train()
        for x, y in train_loader:
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if loss.item() < args.loss_threshold:
                accelerator.set_trigger()  # this process wants to stop
            if accelerator.check_trigger():  # every process calls it; True everywhere if anyone triggered
                stopped_in_epoch = epoch
                break
        if stopped_in_epoch is not None:
            break

    model.eval()
    correct = total = 0
    for x, y in eval_loader:
        with torch.no_grad():
            predictions = model(x).argmax(dim=-1)
        predictions, y = accelerator.gather_for_metrics((predictions, y))
        correct += int((predictions == y).sum())
        total += y.numel()
    stopped = stopped_in_epoch is not None
    reason = f"stopped early at step {step} (epoch {stopped_in_epoch})" if stopped else f"ran all {step} steps"
    accelerator.print(f"{reason}: accuracy {correct / total:.4f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
