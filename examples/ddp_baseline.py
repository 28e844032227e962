"""The same MNIST loop written by hand with DistributedDataParallel: the reference hasten is compared to.

Set-up and clean-up, a DistributedSampler, torchrun's environment; no hasten at all.

    python -m torch.distributed.run --standalone --nproc_per_node 2 examples/ddp_baseline.py
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mnist_digits import BasicNet, load_digits  # noqa: E402


def setup() -> tuple[int, int]:
    """Join the process group torchrun described (gloo on CPU, NCCL on GPUs)."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    return dist.get_rank(), dist.get_world_size()


def cleanup() -> None:
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1.0)
    args = parser.parse_args()
    rank, world = setup()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(42)
    train_set, test_set = load_digits()
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=42)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    test_sampler = DistributedSampler(test_set, num_replicas=world, rank=rank, shuffle=False)
    test_loader = DataLoader(test_set, batch_size=256, sampler=test_sampler)
    model = DistributedDataParallel(BasicNet().to(device), device_ids=[device] if device.type == "cuda" else None)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for images, labels in train_loader:
            images, labels = images.to(device), labels.to(device)
            loss = F.nll_loss(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        scheduler.step()
        model.eval()
        counts = torch.zeros(2, device=device)
        with torch.no_grad():
            for images, labels in test_loader:  # DistributedSampler may repeat a few samples to even out
                predictions = model(images.to(device)).argmax(dim=1)
                counts += torch.tensor([(predictions == labels.to(device)).sum().item(), labels.numel()], device=device)
        dist.all_reduce(counts)
        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f}  test accuracy {counts[0] / counts[1]:.2%}")
    cleanup()


if __name__ == "__main__":
    main()
