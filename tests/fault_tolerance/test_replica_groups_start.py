"""Replica groups at start-up: no group trains the run alone before every launched group has joined a quorum.

Before, a group whose peers were slow to start formed quorums alone (torchft's Lighthouse forms one at once when
every heartbeating replica has joined) and committed steps that no other group ever saw; when it then died, the
other groups started the epoch again from step 0 and the first steps' samples were used twice. Here group 0
comes up only once group 1 has either committed 3 steps alone (and then dies) or waits for it at start, so the
race is decided the same way on every run.

torchft lives in its own venv (``make tft-venv``; ``make test`` passes its interpreter as HASTEN_TORCHFT_PYTHON).
"""

from __future__ import annotations

import collections
import json
import time
from pathlib import Path

import pytest

from helpers.replica_group_runs import run_launch

SAMPLES = 160

LATE_START = '''
import hashlib, json, logging, os, signal, time
import torch
from torch.utils.data import DataLoader, TensorDataset

out = os.environ["FT_OUT"]
group = os.environ["HASTEN_REPLICA_GROUP"]
went_ahead = os.path.join(out, "group1_went_ahead")


class MarkWaiting(logging.Handler):
    """Group 1 waits for the other groups at start: group 0 may come up now."""

    def emit(self, record):
        if "waiting for every replica group" in record.getMessage():
            open(went_ahead, "a").close()


logging.getLogger("hasten.fault_tolerance").addHandler(MarkWaiting(logging.WARNING))
if group == "0":  # the slow group: it starts once group 1 committed steps alone, or waits for it (bounded)
    deadline = time.monotonic() + 120
    while not os.path.exists(went_ahead):
        if time.monotonic() > deadline:
            raise SystemExit("group 1 neither trained alone nor waited for group 0")
        time.sleep(0.05)

from hasten import Accelerator

accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
features = torch.randn(SAMPLES_HERE, 8)
dataset = TensorDataset(torch.arange(SAMPLES_HERE), features, features @ torch.randn(8, 1))
loader = DataLoader(dataset, batch_size=4, shuffle=True)
torch.manual_seed(100 + int(group))
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
manager = accelerator.replica_group.manager
log = open(os.path.join(out, f"steps_g{group}_{os.getpid()}.jsonl"), "a", buffering=1)
for ids, x, y in loader:
    loss = torch.nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    log.write(json.dumps({"step": manager.current_step(), "committed": not optimizer.step_was_skipped,
                          "ids": ids.tolist(), "padded": loader.padded}) + "\\n")
    killed = os.path.join(out, "killed")
    if group == "1" and manager.current_step() >= 3 and not os.path.exists(killed):
        open(killed, "w").close()
        open(went_ahead, "a").close()
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.2)  # emulated compute: group 0 is still training when group 1 comes back
weights = b"".join(p.detach().numpy().tobytes() for p in accelerator.unwrap_model(model).parameters())
with open(os.path.join(out, f"final_g{group}_{os.getpid()}.json"), "w") as f:
    json.dump({"digest": hashlib.sha256(weights).hexdigest(), "step": manager.current_step()}, f)
'''.replace("SAMPLES_HERE", str(SAMPLES))


@pytest.mark.launch
def test_a_group_that_starts_first_waits_for_every_group(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(LATE_START)
    proc = run_launch(tmp_path, script, "--num_processes", "2", "--replica_groups", "2", "--step_timeout", "5")
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert (tmp_path / "killed").exists()
    rows = [json.loads(line) for path in tmp_path.glob("steps_*.jsonl") for line in path.read_text().splitlines()]
    counts = collections.Counter(i for row in rows if row["committed"] and not row["padded"] for i in row["ids"])
    assert sorted(counts) == list(range(SAMPLES)), sorted(set(range(SAMPLES)) - set(counts))
    assert set(counts.values()) == {1}, sorted(i for i, n in counts.items() if n > 1)
    finals = [json.loads(path.read_text()) for path in tmp_path.glob("final_*.json")]
    assert len(finals) == 2, proc.stdout[-4000:]
    assert len({final["digest"] for final in finals}) == 1


NEVER_STARTS = '''
import os
if os.environ["HASTEN_REPLICA_GROUP"] == "1":
    raise SystemExit(3)  # group 1 never comes up
import torch
from hasten import Accelerator

accelerator = Accelerator(cpu=True)
model = torch.nn.Linear(2, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
open(os.path.join(os.environ["FT_OUT"], "trained_alone"), "w").close()
'''


@pytest.mark.launch
@pytest.mark.serial  # a wall-clock bound: run alone, after the parallel part of make test
def test_a_group_that_never_comes_up_stops_the_run_with_a_clear_bounded_error(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(NEVER_STARTS)
    began = time.monotonic()
    # step_timeout 2 s: quorum_timeout 6 s; the start-up wait is the collective (initialisation) timeout, 10 s
    proc = run_launch(tmp_path, script, "--num_processes", "2", "--replica_groups", "2", "--step_timeout", "2",
                      "--collective_timeout", "10", "--group_restarts", "0", timeout=120)
    assert proc.returncode != 0, proc.stdout[-4000:]
    assert "1 of 2 replica groups joined" in proc.stdout, proc.stdout[-4000:]
    assert "collective_timeout=10" in proc.stdout, proc.stdout[-4000:]
    assert not (tmp_path / "trained_alone").exists()
    assert time.monotonic() - began < 90
