"""Sharded data-parallel training with FSDP2 (``torch.distributed.fsdp.fully_shard``), same loop as always.

``FullyShardedDataParallelPlugin`` splits every parameter, gradient and optimizer state across the
processes, so each holds only its share (a model N times larger fits on N devices); parameters are
gathered block by block for forward and backward. Pass the plugin to the Accelerator, or launch with
``hasten launch --use_fsdp`` / a config file with ``distributed_type: FSDP`` (see
``examples/config_templates/fsdp2.yaml``). Prepare the model and the optimizer in the same call.
``accelerator.save_model`` gathers the shards into one ordinary ``model.safetensors``.

    python examples/by_feature/fsdp2.py                                 # one process: a 1-device mesh
    hasten launch --num_processes 2 examples/by_feature/fsdp2.py --output_dir fsdp_model
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator, FullyShardedDataParallelPlugin
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


class Block(nn.Module):
    """A residual MLP block: each Block becomes its own FSDP unit (gathered and freed on its own)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, width: int = 64, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(64, width)
        self.blocks = nn.Sequential(*(Block(width) for _ in range(depth)))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inp(x)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default=None)
    parser.add_argument("--cpu", action="store_true", help="Train on the CPU even if a GPU is available.")
    parser.add_argument("--num_epochs", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=32, help="Per process.")
    parser.add_argument("--output_dir", default=None, help="Save the trained weights (model.safetensors) here.")
    args = parser.parse_args()

    fsdp_plugin = FullyShardedDataParallelPlugin(
        auto_wrap_policy="transformer_based_wrap",  # shard each Block separately, then the rest
        transformer_cls_names_to_wrap=["Block"],
        reshard_after_forward=True,  # free gathered parameters after forward (least memory)
        state_dict_type="SHARDED_STATE_DICT",  # save_state writes one shard per process
    )
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision, fsdp_plugin=fsdp_plugin)
    set_seed(42)
    train_loader, eval_loader = get_dataloaders(args.batch_size)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # The model and its optimizer are prepared together: the optimizer must see the sharded parameters.
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)

    for epoch in range(args.num_epochs):
        model.train()
        for x, y in train_loader:
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)  # the norm over all shards
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
        accelerator.print(f"epoch {epoch}: accuracy {correct / total:.4f} ({accelerator.distributed_type}, "
                          f"{accelerator.num_processes} process(es))")
    if args.output_dir:
        accelerator.save_model(model, args.output_dir)  # every process calls it; the main process writes
        accelerator.print(f"full weights saved to {args.output_dir}/model.safetensors")
    accelerator.end_training()


if __name__ == "__main__":
    main()
