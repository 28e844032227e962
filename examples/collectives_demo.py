"""A real multi-process run of hasten's collectives: each rank prints what it computed.

Run with 2 processes:  python -m torch.distributed.run --standalone --nproc_per_node 2 examples/collectives_demo.py
"""

import torch

from hasten import PartialState
from hasten.utils import gather, gather_object, pad_across_processes, reduce

state = PartialState()
rank, world = state.process_index, state.num_processes
mine = torch.arange(rank + 1, dtype=torch.float32) + 10 * rank  # a different length on each rank
padded = pad_across_processes(mine, pad_index=-1)
gathered = gather(padded)
total = reduce(mine.sum(), reduction="sum")
names = gather_object([f"rank {rank} on {state.device}"])
with state.split_between_processes(list(range(7))) as share:
    pass
state.wait_for_everyone()
for i in range(world):
    if i == rank:
        print(f"[rank {rank}/{world}] local={mine.tolist()} padded={padded.tolist()} share of 0..6={share}\n"
              f"          gathered={gathered.tolist()} sum over ranks={total.item():g} names={names}", flush=True)
    state.wait_for_everyone()
state.print(f"{world} processes ({state.distributed_type}, backend {state.backend}) agreed.")
