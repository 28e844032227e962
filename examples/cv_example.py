"""Train a small ResNet from scratch on scikit-learn's bundled handwritten digits, with hasten.

The 1,797 8x8 digit images ship with scikit-learn (no download). They are upsampled to 16x16 and a
fifth is held out; the default settings reach about 99% held-out accuracy in seconds on a CPU.

    python examples/cv_example.py                                  # one process
    hasten launch --num_processes 2 examples/cv_example.py         # two processes (CPU or GPUs)
    python examples/cv_example.py --mixed_precision bf16           # bf16 autocast
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator
from hasten.utils import set_seed


# ------------------------------------------------------------------------------------------ the data
def load_digit_images(image_size: int = 16, eval_fraction: float = 0.2, seed: int = 0
                      ) -> tuple[TensorDataset, TensorDataset]:
    """The digits as (N, 1, image_size, image_size) float images, split into train and held-out sets."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # pixel values are 0..16
    images = F.interpolate(images, size=(image_size, image_size), mode="bilinear", align_corners=False)
    images = (images - images.mean()) / images.std()
    labels = torch.tensor(digits.target, dtype=torch.long)
    # A fixed permutation (its own generator) so that every process, and every run, holds out the same images.
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_eval = int(len(labels) * eval_fraction)
    eval_idx, train_idx = order[:n_eval], order[n_eval:]
    return TensorDataset(images[train_idx], labels[train_idx]), TensorDataset(images[eval_idx], labels[eval_idx])


def get_dataloaders(batch_size: int, max_train_samples: int | None = None, max_eval_samples: int | None = None,
                    image_size: int = 16) -> tuple[DataLoader, DataLoader]:
    """Plain PyTorch data loaders; ``accelerator.prepare`` shards them across processes later."""
    train_set, eval_set = load_digit_images(image_size)
    if max_train_samples is not None:
        train_set = TensorDataset(*train_set[:max_train_samples])
    if max_eval_samples is not None:
        eval_set = TensorDataset(*eval_set[:max_eval_samples])
    train_loader = DataLoader(train_set, batch_size=batch_size, shuffle=True, drop_last=True)
    eval_loader = DataLoader(eval_set, batch_size=2 * batch_size)
    return train_loader, eval_loader


# ----------------------------------------------------------------------------------------- the model
class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and a skip connection (ResNet's basic block)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_channels != out_channels:  # match the shape of the block's output
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """A small ResNet for 1-channel images: a stem, three stages (the last two halve the size), a linear head."""

    def __init__(self, num_classes: int = 10, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.stages = nn.Sequential(BasicBlock(width, width), BasicBlock(width, 2 * width, stride=2),
                                    BasicBlock(2 * width, 4 * width, stride=2))
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.stages(self.stem(x))
        return self.head(features.mean(dim=(2, 3)))  # global average pooling


# ---------------------------------------------------------------------------------------- training
def training_function(config: dict, args: argparse.Namespace) -> float:
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    set_seed(config["seed"])  # same initial weights on every process (and the same shuffling)
    train_loader, eval_loader = get_dataloaders(config["batch_size"], args.max_train_samples, args.max_eval_samples)
    model = ResNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=1e-4)

    # As in Accelerate, the schedule is sized with the whole data set's number of batches: once prepared,
    # the scheduler advances once per process at every optimizer step.
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=config["lr"], epochs=config["num_epochs"],
                                                    steps_per_epoch=len(train_loader))
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler)

    accuracy = 0.0
    for epoch in range(config["num_epochs"]):
        model.train()
        for images, labels in train_loader:  # batches are already on the right device
            loss = F.cross_entropy(model(images), labels)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()

        model.eval()
        correct = total = 0
        for images, labels in eval_loader:
            with torch.no_grad():
                predictions = model(images).argmax(dim=-1)
            # Collect every process's predictions; the samples added to even out the last batch are dropped.
            predictions, labels = accelerator.gather_for_metrics((predictions, labels))
            correct += int((predictions == labels).sum())
            total += labels.numel()
        accuracy = correct / total
        accelerator.print(f"epoch {epoch}: accuracy {accuracy:.4f} ({correct}/{total} held-out images)")
    accelerator.end_training()
    return accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description="Train a small ResNet on the scikit-learn digits.")
    parser.add_argument("--mixed_precision", type=str, default=None, choices=["no", "fp16", "bf16"],
                        help="Mixed precision (default: the launch configuration's, else 'no').")
    parser.add_argument("--cpu", action="store_true", help="Train on the CPU even if a GPU is available.")
    parser.add_argument("--num_epochs", type=int, default=5)
    parser.add_argument("--batch_size", type=int, default=32, help="Per process.")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--max_train_samples", type=int, default=None, help="Use only the first N training images.")
    parser.add_argument("--max_eval_samples", type=int, default=None, help="Use only the first N held-out images.")
    args = parser.parse_args()
    config = {"lr": args.lr, "num_epochs": args.num_epochs, "seed": args.seed, "batch_size": args.batch_size}
    training_function(config, args)


if __name__ == "__main__":
    main()
