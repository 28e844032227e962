"""DeepSpeed ZeRO through the ordinary loop: ``DeepSpeedPlugin`` and nothing else changes.

ZeRO stage 1 shards the optimizer state across processes, stage 2 also the gradients, stage 3 also
the parameters; ``offload_optimizer_device="cpu"`` keeps the optimizer state in CPU memory. The plugin
builds DeepSpeed's JSON config (batch sizes, accumulation and clipping filled in from the Accelerator);
pass ``hf_ds_config="ds_config.json"`` to use your own file. ``hasten launch --use_deepspeed`` or a
config file (``examples/config_templates/deepspeed.yaml``) does the same without code changes.
(The file is not called deepspeed.py: it would hide the deepspeed package from ``import deepspeed``.)

    python examples/by_feature/deepspeed_zero.py --zero_stage 2
    hasten launch --num_processes 2 examples/by_feature/deepspeed_zero.py --zero_stage 3
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator, DeepSpeedPlugin
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
    parser.add_argument("--zero_stage", type=int, default=2, choices=[0, 1, 2, 3])
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--num_epochs", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=16, help="Micro-batch size per process.")
    args = parser.parse_args()

    # Accumulation steps left unset ("auto") in the plugin are taken from the Accelerator.
    deepspeed_plugin = DeepSpeedPlugin(zero_stage=args.zero_stage, gradient_clipping=1.0)
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision, deepspeed_plugin=deepspeed_plugin,
                              gradient_accumulation_steps=args.gradient_accumulation_steps)
    set_seed(42)
    train_loader, eval_loader = get_dataloaders(args.batch_size)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # deepspeed.initialize runs inside prepare: the model and its optimizer go in the same call.
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)

    for epoch in range(args.num_epochs):
        model.train()
        for x, y in train_loader:
            with accelerator.accumulate(model):  # the DeepSpeed engine counts the micro-batches itself
                # With --mixed_precision the engine keeps bf16/fp16 weights: feed it inputs of that type.
                loss = F.cross_entropy(model(x.to(next(model.parameters()).dtype)).float(), y)
                accelerator.backward(loss)  # the engine's backward (loss scaling, ZeRO reduce-scatter)
                optimizer.step()  # the engine's step: clipping and the optimizer, on the sync step only
                optimizer.zero_grad()

        model.eval()
        correct = total = 0
        for x, y in eval_loader:
            with torch.no_grad():
                predictions = model(x.to(next(model.parameters()).dtype)).argmax(dim=-1)
            predictions, y = accelerator.gather_for_metrics((predictions, y))
            correct += int((predictions == y).sum())
            total += y.numel()
        accelerator.print(f"epoch {epoch}: accuracy {correct / total:.4f} (ZeRO stage {args.zero_stage}, "
                          f"{accelerator.num_processes} process(es))")
    accelerator.end_training()


if __name__ == "__main__":
    main()
