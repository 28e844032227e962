"""N-D parallelism: tensor parallel, FSDP2 and replication on one DeviceMesh, with the usual loop.

``ParallelismConfig`` arranges the processes in a mesh ``(dp_replicate, dp_shard, tp)``: attention
and MLP weights are split over the ``tp`` ranks (a plan of module-name patterns), every replica is
sharded over ``dp_shard`` (FSDP2), and replicas average their gradients (HSDP). Ranks of one TP
group read the same batches; ``gather_for_metrics`` counts every evaluation sample once.

    python examples/by_feature/nd_parallel.py                                     # one process
    hasten launch --cpu --num_processes 4 examples/by_feature/nd_parallel.py --tp_size 2 --dp_shard_size 2
    hasten launch --cpu --num_processes 4 examples/by_feature/nd_parallel.py --dp_replicate_size 2 --dp_shard_size 2
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator, ParallelismConfig
from hasten.utils import TorchTensorParallelConfig, set_seed

VOCAB, SEQ = 32, 16
#: Tensor-parallel plan: q/k/v and the MLP's first layer split by output features (heads), their
#: partners by input features, so each block needs one all-reduce in forward and one in backward.
TP_PLAN = {"blocks.*.attn.q_proj": "colwise", "blocks.*.attn.k_proj": "colwise", "blocks.*.attn.v_proj": "colwise",
           "blocks.*.attn.o_proj": "rowwise", "blocks.*.mlp.up": "colwise", "blocks.*.mlp.down": "rowwise"}


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(width, width) for _ in range(3))
        self.o_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallel each rank holds heads / tp_size of them.
        q, k, v = (proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn, self.mlp = Attention(width, heads), MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    def __init__(self, width: int = 32, heads: int = 4, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.pos = nn.Parameter(torch.zeros(SEQ, width))
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def get_dataloaders(batch_size: int) -> tuple[DataLoader, DataLoader]:
    """Counting sequences (start, start+1, ... mod VOCAB): the next token is learnable from the current one."""
    starts = torch.randint(0, VOCAB, (640,), generator=torch.Generator().manual_seed(0))
    tokens = (starts[:, None] + torch.arange(SEQ + 1)) % VOCAB
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    train, held_out = torch.utils.data.random_split(data, [540, 100], generator=torch.Generator().manual_seed(1))
    return DataLoader(train, batch_size=batch_size, shuffle=True), DataLoader(held_out, batch_size=32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp_replicate_size", type=int, default=1)
    parser.add_argument("--dp_shard_size", type=int, default=1)
    parser.add_argument("--tp_size", type=int, default=1)
    parser.add_argument("--cpu", action="store_true", help="Train on the CPU even if a GPU is available.")
    parser.add_argument("--num_epochs", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=16, help="Per data-parallel rank.")
    args = parser.parse_args()

    sizes = (args.dp_replicate_size, args.dp_shard_size, args.tp_size)
    config = None if sizes == (1, 1, 1) else ParallelismConfig(
        dp_replicate_size=args.dp_replicate_size, dp_shard_size=args.dp_shard_size, tp_size=args.tp_size,
        tp_handler=TorchTensorParallelConfig(tp_plan=TP_PLAN) if args.tp_size > 1 else None)
    accelerator = Accelerator(cpu=args.cpu, parallelism_config=config)
    if accelerator.torch_device_mesh is not None:
        mesh = accelerator.torch_device_mesh
        accelerator.print(f"mesh {dict(zip(mesh.mesh_dim_names, mesh.shape))} over {accelerator.num_processes} processes")
    set_seed(42)
    train_loader, eval_loader = get_dataloaders(args.batch_size)
    model = TinyTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)

    for epoch in range(args.num_epochs):
        model.train()
        for tokens, targets in train_loader:
            loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        model.eval()
        correct = total = 0
        for tokens, targets in eval_loader:
            with torch.no_grad():
                predictions = model(tokens).argmax(-1)
            predictions, targets = accelerator.gather_for_metrics((predictions, targets))
            correct += int((predictions == targets).all(dim=1).sum())
            total += len(targets)
        accelerator.print(f"epoch {epoch}: loss {loss.item():.4f}, sequence accuracy {correct / total:.3f} "
                          f"over {total} held-out sequences")
    accelerator.end_training()


if __name__ == "__main__":
    main()
