"""Profile training steps with ``accelerator.profile()`` and ``ProfileKwargs`` (torch.profiler underneath).

``ProfileKwargs`` holds torch.profiler's settings (activities, a wait/warmup/active schedule, shapes,
memory, FLOPs); ``with accelerator.profile(handler) as prof:`` runs the block under the profiler,
and with ``output_trace_dir`` every process writes a Chrome trace ``profile_{rank}.json`` there
(open it in chrome://tracing or https://ui.perfetto.dev). Call ``prof.step()`` once per training
step when you use a schedule.

    python examples/by_feature/profiler.py --output_trace_dir traces
    hasten launch --num_processes 2 examples/by_feature/profiler.py --output_trace_dir traces
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator, ProfileKwargs
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
    parser.add_argument("--output_trace_dir", default=None, help="Write profile_{rank}.json Chrome traces here.")
    parser.add_argument("--num_steps", type=int, default=8, help="Training steps to profile.")
    parser.add_argument("--batch_size", type=int, default=32, help="Per process.")
    args = parser.parse_args()

    # Skip 1 step, warm up for 1, record the next 3 (the schedule needs prof.step() after each step).
    profile_kwargs = ProfileKwargs(activities=["cpu"], record_shapes=True, output_trace_dir=args.output_trace_dir,
                                   schedule_option={"wait": 1, "warmup": 1, "active": 3, "repeat": 1})
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision, kwargs_handlers=[profile_kwargs])
    set_seed(42)
    train_loader, _ = get_dataloaders(args.batch_size)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)

    model.train()
    with accelerator.profile() as prof:  # uses the ProfileKwargs given to the Accelerator
        for step, (x, y) in enumerate(train_loader):
            if step == args.num_steps:
                break
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            prof.step()

    # The operators that took the most CPU time on this process.
    accelerator.print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
    if args.output_trace_dir:
        accelerator.print(f"Chrome traces written to {args.output_trace_dir}/profile_<rank>.json")
    accelerator.end_training()


if __name__ == "__main__":
    main()
