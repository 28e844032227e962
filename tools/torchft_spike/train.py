"""One torchft replica group member: a tiny Linear model over gloo, one JSON line per step.

Run under torchrun (its agent store is the group's TCPStore).  Env: TORCHFT_LIGHTHOUSE, REPLICA_GROUP_ID,
NUM_REPLICA_GROUPS, SPIKE_STEPS (stop after this many committed steps), SPIKE_OUT (log folder),
SPIKE_STEP_S (emulated compute time per step), SPIKE_TIMEOUT_S (managed group / manager timeout).
"""
import hashlib
import json
import os
import time

T_START = time.time()
from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torchft  # noqa: E402
from torchft import DistributedDataParallel, DistributedSampler, Manager, ProcessGroupGloo  # noqa: E402
from torchft.optim import OptimizerWrapper  # noqa: E402

T_IMPORTED = time.time()
GROUP = int(os.environ["REPLICA_GROUP_ID"])
NUM_GROUPS = int(os.environ["NUM_REPLICA_GROUPS"])
RANK = int(os.environ["RANK"])
STEPS = int(os.environ.get("SPIKE_STEPS", "40"))
STEP_S = float(os.environ.get("SPIKE_STEP_S", "0.2"))
TIMEOUT = timedelta(seconds=float(os.environ.get("SPIKE_TIMEOUT_S", "5")))
OUT = os.environ["SPIKE_OUT"]
INCARNATION = os.environ.get("SPIKE_INCARNATION", "0")
BATCH = 8

log = open(os.path.join(OUT, f"g{GROUP}_r{RANK}_i{INCARNATION}.jsonl"), "a", buffering=1)


def emit(**kw: object) -> None:
    log.write(json.dumps({"t": time.time(), "group": GROUP, "rank": RANK, "inc": INCARNATION, **kw}) + "\n")


torch.manual_seed(0)
features = torch.randn(4096, 16)
targets = features @ torch.randn(16, 4)
dataset = torch.utils.data.TensorDataset(torch.arange(4096), features, targets)
# torchft's sampler: shard = group_rank + num_replicas * replica_rank; DDP groups use num_replicas=1.
sampler = DistributedSampler(dataset, replica_rank=GROUP, num_replica_groups=NUM_GROUPS,
                             group_rank=0, num_replicas=1, shuffle=False)
shard = list(iter(sampler))

model = torch.nn.Linear(16, 4)
inner_opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def state_dict() -> dict:
    return {"model": model.state_dict(), "optim": inner_opt.state_dict()}


def load_state_dict(sd: dict) -> None:
    model.load_state_dict(sd["model"])
    inner_opt.load_state_dict(sd["optim"])
    emit(event="healed_load")


T_DATA = time.time()
pg = ProcessGroupGloo(timeout=TIMEOUT)
manager = Manager(pg=pg, min_replica_size=1, load_state_dict=load_state_dict, state_dict=state_dict,
                  replica_id=f"spike_{GROUP}", timeout=TIMEOUT, quorum_timeout=TIMEOUT * 2,
                  connect_timeout=TIMEOUT, hostname="127.0.0.1")
REDUCE = os.environ.get("SPIKE_REDUCE", "ddp")
# "ddp": torchft.DistributedDataParallel (comm hook); "manual": one managed all-reduce per gradient after
# backward, each waited with _ManagedWork.wait() (which reports an error instead of raising).
ddp = DistributedDataParallel(manager, model) if REDUCE == "ddp" else model
T_MANAGER = time.time()
opt = OptimizerWrapper(manager, inner_opt)
emit(event="ready", pid=os.getpid(), import_s=T_IMPORTED - T_START, setup_s=time.time() - T_IMPORTED, manager_s=T_MANAGER - T_DATA, torchft=torchft.__file__)


def params_digest() -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]


while manager.current_step() < STEPS:
    t0 = time.time()
    opt.zero_grad()  # start_quorum (async)
    manager.wait_quorum()  # so current_step() below is the post-heal step
    step = manager.current_step()  # the step this batch is for (committed steps so far)
    pos = (step * BATCH) % len(shard)
    idx = shard[pos:pos + BATCH]
    ids, x, y = dataset[idx]
    if os.environ.get("SPIKE_COMPUTE_FIRST") == "1":
        time.sleep(STEP_S)  # emulated compute before the all-reduce: a kill lands inside a quorum'd step
    loss = torch.nn.functional.mse_loss(ddp(x), y)
    loss.backward()  # with REDUCE == "ddp" the managed all-reduce runs in DDP's comm hook
    if REDUCE == "manual":
        works = [manager.allreduce(p.grad) for p in model.parameters()]
        ok = [w.wait() for w in works]
    if os.environ.get("SPIKE_COMPUTE_FIRST") != "1":
        time.sleep(STEP_S)  # emulated compute, so the drill has a pace to observe
    committed = manager.should_commit()
    if committed:
        inner_opt.step()  # OptimizerWrapper.step would call should_commit a second time
    emit(event="step", step=step, committed=committed, after=manager.current_step(),
         participants=manager.num_participants(), participating=manager.is_participating(), quorum_id=manager._quorum_id,
         digest=params_digest(), ids=ids.tolist(), loss=float(loss), dt=time.time() - t0)

torch.save({n: p.detach().clone() for n, p in model.named_parameters()},
           os.path.join(OUT, f"final_g{GROUP}_r{RANK}_i{INCARNATION}.pt"))
emit(event="done", step=manager.current_step(), digest=params_digest())
manager.shutdown(wait=False)
os._exit(0)
