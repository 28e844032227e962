"""Replica groups whose processes shard the model: FSDP2 (``--use_fsdp``) or tensor parallel in each group of 2.

(a) 2 groups x 2 processes (FSDP2, or TP), no failure: the final weights and every step's clipped gradient norm
equal a plain single-process run over the same global batches (the cross-group all-reduce runs on each rank's
local shards; clipping sees the full model's gradient averaged over every group). (b) the same FSDP2 layout with
one process SIGKILLing itself: the run exits 0, its group restarts and heals its shards from the same ranks of
the live group, every process ends with bit-equal gathered weights and optimizer state, and the epoch sees every
sample exactly once. (c) TP groups that start from different weights end bit-equal.
"""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.replica_group_runs import run_launch

SAMPLES = 192
#: with the kill: group 0 alone needs ~60 steps after it, room for group 1's restart on a loaded machine
KILL_SAMPLES = 1024
BATCH = 4  # per process: 4 processes read 16 samples per committed step
CLIP = 0.2

TRAIN_TEMPLATE = '''
import dataclasses, hashlib, json, os, signal, time
import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset
from hasten import Accelerator, ParallelismConfig
from hasten.fault_tolerance import FaultToleranceConfig
from hasten.utils import TorchTensorParallelConfig

out = os.environ["FT_OUT"]
config = FaultToleranceConfig.from_json(os.environ["HASTEN_FAULT_TOLERANCE"])
layout = {}
if TP_HERE:  # tensor parallel over the group's 2 processes (they read the same batches)
    layout["parallelism_config"] = ParallelismConfig(tp_size=2, tp_handler=TorchTensorParallelConfig(
        tp_plan={"0": "colwise", "2": "rowwise"}))
accelerator = Accelerator(cpu=True, fault_tolerance=dataclasses.replace(config, min_replicas=MIN_REPLICAS_HERE),
                          **layout)
group, rank = os.environ["HASTEN_REPLICA_GROUP"], accelerator.process_index
torch.manual_seed(0)
features = torch.randn(SAMPLES_HERE, 8)
dataset = TensorDataset(torch.arange(SAMPLES_HERE), features, torch.tanh(features @ torch.randn(8, 2)))
loader = DataLoader(dataset, batch_size=BATCH_HERE, shuffle=SHUFFLE_HERE)
torch.manual_seed(1 + SEED_STEP_HERE * int(group))
model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
log = open(os.path.join(out, f"steps_g{group}_r{rank}_{os.getpid()}.jsonl"), "a", buffering=1)
manager = accelerator.replica_group.manager
for ids, x, y in loader:
    # Killed once the batch is read: the step's quorum counted both ranks, so both logged the step before.
    marker = os.path.join(out, "killed")
    if KILL_HERE and group == "1" and rank == 0 and manager.current_step() >= 6 and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
    norm = accelerator.clip_grad_norm_(model.parameters(), CLIP_HERE)
    optimizer.step()
    optimizer.zero_grad()
    log.write(json.dumps({"step": manager.current_step(), "committed": not optimizer.step_was_skipped,
                          "ids": ids.tolist(), "padded": loader.padded, "norm": float(norm)}) + "\\n")
    time.sleep(SLEEP_HERE)

def full(tensor):
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()

weights = {name: full(value) for name, value in accelerator.unwrap_model(model).state_dict().items()}
momentum = [full(optimizer.optimizer.state[p]["momentum_buffer"]) for p in accelerator.unwrap_model(model).parameters()]
with open(os.path.join(out, f"final_g{group}_r{rank}_{os.getpid()}.json"), "w") as f:
    json.dump({"weights": {name: value.tolist() for name, value in weights.items()},
               "digest": hashlib.sha256(b"".join(v.numpy().tobytes() for v in weights.values())).hexdigest(),
               "momentum": hashlib.sha256(b"".join(v.numpy().tobytes() for v in momentum)).hexdigest(),
               "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
               "step": manager.current_step(), "healed": accelerator.replica_group.healed}, f)
'''


def train_script(*, kill: bool, layout: str = "fsdp2", same_start: bool = True) -> str:
    """Without a kill: both groups in every step, the dataset in order; with one: group 1's rank 0 kills itself at
    step 6, shuffled data. ``same_start``: the groups start from the same weights (else from different ones)."""
    tp = layout == "tp"
    values = {"MIN_REPLICAS": 1 if kill else 2, "SAMPLES": KILL_SAMPLES if kill else SAMPLES, "BATCH": BATCH,
              "SHUFFLE": kill, "SEED_STEP": 0 if same_start else 100, "CLIP": CLIP, "KILL": kill, "TP": tp,
              "SLEEP": 0.3 if kill else 0.0}
    script = TRAIN_TEMPLATE
    for name, value in values.items():
        script = script.replace(f"{name}_HERE", repr(value))
    return script


def launch(out: Path, *, kill: bool, layout: str = "fsdp2",
           same_start: bool = True) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]]:
    """Run the script over 2 groups x 2 processes (layout fsdp2 or tp); (output, committed step rows, final records)."""
    script = out / "train.py"
    script.write_text(train_script(kill=kill, layout=layout, same_start=same_start))
    sharding = ("--use_fsdp", "--fsdp_version", "2") if layout == "fsdp2" else ()
    proc = run_launch(out, script, "--num_processes", "4", "--replica_groups", "2", *sharding, "--step_timeout", "5",
                      timeout=400)
    assert proc.returncode == 0, proc.stdout[-5000:]
    rows = [json.loads(line) for path in sorted(out.glob("steps_*.jsonl")) for line in path.read_text().splitlines()]
    finals = [json.loads(path.read_text()) for path in sorted(out.glob("final_*.json"))]
    assert len(finals) == 4, proc.stdout[-5000:]
    assert all(final["sharded"] for final in finals)  # every process trained shards (DTensor parameters)
    return proc.stdout, [row for row in rows if row["committed"]], finals


def plain_run(step: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, no hasten: the same data, initial weights and optimizer, ``step`` samples per step in order."""
    torch.manual_seed(0)
    features = torch.randn(SAMPLES, 8)
    targets = torch.tanh(features @ torch.randn(8, 2))
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    norms = []
    for start in range(0, SAMPLES, step):
        x, y = features[start:start + step], targets[start:start + step]
        torch.nn.functional.mse_loss(model(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
    return {name: value.detach() for name, value in model.state_dict().items()}, norms


@pytest.mark.launch
@pytest.mark.parametrize("layout", ["fsdp2", "tp"])
def test_sharded_groups_without_failure_equal_a_plain_run(tmp_path: Path, layout: str) -> None:
    output, rows, finals = launch(tmp_path, kill=False, layout=layout)
    # FSDP2: the 4 processes read 4 batches per step; TP: a group's 2 processes share one batch
    expected, expected_norms = plain_run((2 if layout == "tp" else 4) * BATCH)
    assert max(expected_norms) > CLIP  # the clip acts in some steps
    steps = sorted({row["step"] for row in rows})
    assert len(steps) == len(expected_norms), output[-3000:]
    for row in rows:  # every process clipped by the full model's norm of the gradient averaged over both groups
        assert row["norm"] == pytest.approx(expected_norms[steps.index(row["step"])], rel=1e-5, abs=1e-6)
    for final in finals:
        for name, value in expected.items():
            torch.testing.assert_close(torch.tensor(final["weights"][name]), value, rtol=0, atol=1e-6)


# torchft heals group rank r from the r-th group while no step has committed (its per-rank primary), so groups
# that start from different weights leave a group's ranks with different groups' state; hasten realigns what a
# group replicates after each such quorum: DDP's parameters (test_replica_groups_launch.py's
# test_groups_of_two_processes_that_start_apart_end_as_one_replica) and, here, a row-wise TP layer's Replicate bias.
@pytest.mark.launch
def test_tp_groups_that_start_from_different_weights_end_bit_equal(tmp_path: Path) -> None:
    output, _rows, finals = launch(tmp_path, kill=False, layout="tp", same_start=False)
    assert len({final["digest"] for final in finals}) == 1, output[-3000:]
    assert len({final["momentum"] for final in finals}) == 1


@pytest.mark.launch
def test_fsdp2_group_killed_heals_its_shards_from_the_live_group(tmp_path: Path) -> None:
    output, rows, finals = launch(tmp_path, kill=True, same_start=False)
    assert (tmp_path / "killed").exists()
    assert re.search(r"replica group 1 (was killed by signal 9|exited with code \d+); restarting it", output), \
        output[-4000:]
    healed = [json.loads(path.read_text())["healed"] for path in tmp_path.glob("final_g1_*.json")]
    assert len(healed) == 2 and min(healed) >= 1, output[-4000:]  # both ranks of group 1 loaded their peer's shards
    assert len({final["digest"] for final in finals}) == 1  # gathered weights bit-equal on all 4 processes
    assert len({final["momentum"] for final in finals}) == 1  # and the optimizer state
    assert len({final["step"] for final in finals}) == 1
    counts = collections.Counter(i for row in rows if not row["padded"] for i in row["ids"])
    assert sorted(counts) == list(range(KILL_SAMPLES)), sorted(set(range(KILL_SAMPLES)) - set(counts))
    assert set(counts.values()) == {1}, [i for i, n in counts.items() if n > 1]
