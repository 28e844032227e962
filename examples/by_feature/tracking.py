"""Experiment tracking: log hyperparameters and metrics to TensorBoard, MLflow, W&B or JSON lines.

``Accelerator(log_with=..., project_dir=...)`` chooses the trackers; ``init_trackers(name, config)``
starts them (on the main process only) and records the hyperparameters; ``accelerator.log(dict,
step=...)`` logs from any process (only the main process writes); ``end_training()`` closes them.
``--report_to jsonl`` needs no extra package: it writes ``{project_dir}/{name}/metrics.jsonl``.

    python examples/by_feature/tracking.py --report_to jsonl --project_dir runs
    python examples/by_feature/tracking.py --report_to tensorboard --project_dir runs   # tensorboard --logdir runs
    hasten launch --num_processes 2 examples/by_feature/tracking.py --report_to tensorboard
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
    parser.add_argument("--report_to", default="jsonl",
                        help="jsonl (no extra package), tensorboard, mlflow, wandb, or 'all' (every installed one).")
    parser.add_argument("--project_dir", default="tracking_logs", help="Where the trackers write.")
    parser.add_argument("--num_epochs", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=32, help="Per process.")
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args()

    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision, log_with=args.report_to,
                              project_dir=args.project_dir)
    config = {"lr": args.lr, "num_epochs": args.num_epochs, "batch_size": args.batch_size}
    accelerator.init_trackers("tracking_example", config=config)  # call it on every process

    set_seed(42)
    train_loader, eval_loader = get_dataloaders(args.batch_size)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)

    step = 0
    for epoch in range(args.num_epochs):
        model.train()
        for x, y in train_loader:
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % 10 == 0:
                accelerator.log({"train_loss": loss.item()}, step=step)

        model.eval()
        correct = total = 0
        for x, y in eval_loader:
            with torch.no_grad():
                predictions = model(x).argmax(dim=-1)
            predictions, y = accelerator.gather_for_metrics((predictions, y))
            correct += int((predictions == y).sum())
            total += y.numel()
        accelerator.log({"accuracy": correct / total, "epoch": epoch}, step=step)
        accelerator.print(f"epoch {epoch}: accuracy {correct / total:.4f}")
    accelerator.print(f"logged to {[tracker.name for tracker in accelerator.trackers]} under {args.project_dir}")
    accelerator.end_training()  # flushes and closes every tracker


if __name__ == "__main__":
    main()
