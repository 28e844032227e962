"""The small residual network the memory-plan tests plan and measure (FSDP2 units are its blocks)."""

import torch
from torch import nn


class Block(nn.Module):
    """One residual MLP block: the unit FSDP2 shards (named in ``_no_split_modules``)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class TinyNet(nn.Module):
    """``depth`` blocks of ``width`` and a head of 8 outputs."""

    _no_split_modules = ["Block"]  # FSDP2 units, as a transformers model names its blocks

    def __init__(self, width: int = 128, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)
