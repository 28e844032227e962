"""One hasten training script, run unchanged by ``hasten launch`` and as Ray TorchTrainer's training function.

``python train.py CONFIG_JSON`` (the ``hasten launch`` run) or ``train(config)`` (``TorchTrainer``). The config:
``out`` (a folder for the weights and the sample log), and for the Ray runs that checkpoint through
``hasten.integrations.ray``: ``report_every`` (save and report every N optimizer steps), ``kill_at`` (the last
worker kills itself with SIGKILL after that step, once: a marker file records it), ``resume_from`` (the
checkpoint to start from when Ray has none for the run), ``preempt_at`` and ``leaving_node`` (after that step
the driver drains that Ray node: every worker saves on Ray's preemption notice, then the worker there waits until
the driver removes the node), ``fsdp`` (write each worker's share of the first
layer's weight). Every worker logs, per optimizer step, the ids of the samples it
trained on, tagged with the attempt (rank 0's clock when the attempt started) and the number of workers.
"""

import json
import os
import signal
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator
from hasten.utils import broadcast_object_list, set_seed

GLOBAL_BATCH, SAMPLES, EPOCHS = 8, 32, 2  # 4 optimizer steps per epoch on 1 or 2 workers


class Progress:
    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def _on_node(node_id):
    import ray

    return ray.get_runtime_context().get_node_id() == node_id


def _save_on_the_preemption_notice(accelerator, hasten_ray, step, config):
    """Here the driver drains the node named ``leaving_node``: every worker waits for Ray's preemption notice and
    saves at this step (once), then the worker on that node waits to be ended with it."""
    out = config["out"]
    leaving = _on_node(config["leaving_node"])
    if leaving:
        open(os.path.join(out, "drain"), "w").close()
    folder = os.path.join(out, "checkpoints", f"step_{step}")
    deadline = time.monotonic() + 120
    # Each call is one exchange between the workers (they agree on the answer); in a real loop it is made at
    # every step or every few, and training goes on meanwhile. Here the steps take no time, so wait for it.
    while hasten_ray.save_if_preempted(accelerator, {"step": step}, folder) is None:
        if time.monotonic() > deadline:
            raise RuntimeError("no preemption notice within 120 s")
        time.sleep(0.1)
    if leaving:
        import ray.train

        ray.train.get_all_reported_checkpoints(ray.train.CheckpointConsistencyMode.COMMITTED)
        open(os.path.join(out, "saved"), "w").close()
        while time.monotonic() < deadline:  # the node's removal ends this process
            time.sleep(0.1)
        raise RuntimeError("the node was not removed within 120 s")


def train(config):
    accelerator = Accelerator(cpu=True)
    world, rank = accelerator.num_processes, accelerator.process_index
    set_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    x = torch.randn(SAMPLES, 4, generator=torch.Generator().manual_seed(3))
    dataset = TensorDataset(torch.arange(SAMPLES), x, torch.sin(x.sum(1, keepdim=True)))
    loader = DataLoader(dataset, batch_size=GLOBAL_BATCH // world, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    every = config.get("report_every")
    if every:
        from hasten.integrations import ray as hasten_ray

        hasten_ray.load_checkpoint(accelerator, default=config.get("resume_from"))
    if config.get("fsdp"):
        shard = next(model.parameters())
        local = shard.to_local() if hasattr(shard, "to_local") else shard
        facts = {"rows": local.shape[0], "distributed_type": str(accelerator.distributed_type),
                 "mixed_precision": accelerator.mixed_precision}
        with open(os.path.join(config["out"], f"fsdp-rank{rank}.json"), "w") as f:
            json.dump(facts, f)
    attempt = broadcast_object_list([time.time_ns()])[0]
    log = open(os.path.join(config["out"], f"samples-rank{rank}.jsonl"), "a")
    for _ in range(loader.state_dict()["epoch"], EPOCHS):
        for ids, xb, yb in loader:
            loss = nn.functional.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            progress.step += 1
            log.write(json.dumps({"attempt": attempt, "world": world, "step": progress.step,
                                  "ids": ids.tolist()}) + "\n")
            log.flush()
            if every and progress.step % every == 0:
                folder = os.path.join(config["out"], "checkpoints", f"step_{progress.step}")
                hasten_ray.report(accelerator, {"step": progress.step, "loss": loss.item()}, folder)
            if config.get("preempt_at") == progress.step:
                _save_on_the_preemption_notice(accelerator, hasten_ray, progress.step, config)
            marker = os.path.join(config["out"], "killed")
            if config.get("kill_at") == progress.step and rank == world - 1 and not os.path.exists(marker):
                open(marker, "w").close()
                # Ray registers a report a moment after it returns: wait until it holds the last checkpoint,
                # so the restart resumes from it and not from the one before.
                import ray.train

                ray.train.get_all_reported_checkpoints(ray.train.CheckpointConsistencyMode.COMMITTED)
                os.kill(os.getpid(), signal.SIGKILL)
    log.close()
    weights = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        torch.save({"step": progress.step, "weights": weights}, os.path.join(config["out"], "weights.pt"))


if __name__ == "__main__":
    train(json.loads(sys.argv[1]))
