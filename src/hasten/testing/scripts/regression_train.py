"""A tiny regression trained with ``Accelerator`` on a fixed, shuffled dataset: the multi-machine tests' workload.

``python regression_train.py OUT GLOBAL_BATCH CRASH_RANK``: every process uses ``GLOBAL_BATCH //
num_processes`` samples per step, so any number of processes trains exactly like one process with
``GLOBAL_BATCH``. Each rank writes ``OUT/rank{i}.json`` (final weights, world size, and for launched runs
the addresses its launcher's process tree listens on). ``CRASH_RANK`` (>= 0) raises in that rank in the
second epoch, after printing ``crash-at <unix time>``; -1 crashes nowhere.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def _listening_addresses() -> list[str]:
    """The addresses the launcher (this process's parent) and its children listen on."""
    import psutil

    tree = psutil.Process(os.getppid())
    pids = {tree.pid, *(p.pid for p in tree.children(recursive=True))}
    return sorted({c.laddr.ip for c in psutil.net_connections("inet") if c.pid in pids and c.status == "LISTEN"})


def main(argv: list[str]) -> None:
    """Train, optionally crash one rank, and write this rank's result file."""
    from hasten import Accelerator
    from hasten.utils import set_seed

    out, global_batch, crash_rank = argv[0], int(argv[1]), int(argv[2])
    accelerator = Accelerator(cpu=True)
    set_seed(0)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(48, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(48, 1, generator=g)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(x, y), batch_size=global_batch // accelerator.num_processes, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    launched = os.environ.get("TORCHELASTIC_RUN_ID") is not None  # under hasten launch / torchrun
    accelerator.wait_for_everyone()  # every listener of the process group exists now
    listening = _listening_addresses() if launched and accelerator.local_process_index == 0 else []
    for epoch in range(2):
        for xb, yb in loader:
            if accelerator.process_index == crash_rank and epoch == 1:
                print(f"crash-at {time.time():.3f}", flush=True)
                raise RuntimeError(f"rank {crash_rank} fails on purpose")
            loss = nn.functional.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    trained = accelerator.unwrap_model(model)
    assert isinstance(trained, nn.Linear)
    weights = [round(v, 6) for v in trained.weight.flatten().tolist()]
    with open(os.path.join(out, f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump({"weights": weights, "world": accelerator.num_processes, "listening": listening,
                   "master": os.environ.get("MASTER_ADDR"), "host": os.uname().nodename}, f)


if __name__ == "__main__":
    main(sys.argv[1:])
