"""Replica groups over several machines: ``hasten launch --num_machines 2 --machine_rank r --replica_groups 4`` on
each of two simulated machines (a network namespace and address each), 2 whole groups per machine, the Lighthouse
on machine 0 at the main address. Every group trains, the weights end bit-equal on both machines, the epoch sees
every sample once; the dry run shows each machine's groups; a group that would span machines is refused.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hasten.testing.netns import netns_unavailable, simulated_machines
from helpers.replica_group_runs import ROOT, finish, launch_argv, launch_env, new_tag

pytestmark = [pytest.mark.launch]
_WHY_NOT = netns_unavailable()
needs_netns = pytest.mark.skipif(_WHY_NOT is not None, reason=f"simulated machines unavailable: {_WHY_NOT}")

SAMPLES = 128
PORT = 29531  # fixed ports are safe here: each test's namespaces are new and hold nothing else

TRAIN = '''
import hashlib, json, os
import torch
from torch.utils.data import DataLoader, TensorDataset
from hasten import Accelerator

out = os.environ["FT_OUT"]
accelerator = Accelerator(cpu=True)  # --min_replicas 4: every group in every committed step
group, rank = os.environ["HASTEN_REPLICA_GROUP"], accelerator.process_index
torch.manual_seed(0)
features = torch.randn(SAMPLES_HERE, 8)
dataset = TensorDataset(torch.arange(SAMPLES_HERE), features, features @ torch.randn(8, 1))
loader = DataLoader(dataset, batch_size=4, shuffle=True)
torch.manual_seed(100)
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
manager = accelerator.replica_group.manager
with open(os.path.join(out, f"steps_g{group}_r{rank}.jsonl"), "w") as log:
    for ids, x, y in loader:
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        log.write(json.dumps({"step": manager.current_step(), "committed": not optimizer.step_was_skipped,
                              "ids": ids.tolist(), "padded": loader.padded}) + "\\n")
weights = b"".join(p.detach().numpy().tobytes() for p in accelerator.unwrap_model(model).parameters())
with open(os.path.join(out, f"final_g{group}_r{rank}.json"), "w") as f:
    json.dump({"digest": hashlib.sha256(weights).hexdigest(), "step": manager.current_step(),
               "store": os.environ["MASTER_ADDR"], "lighthouse": os.environ["TORCHFT_LIGHTHOUSE"]}, f)
'''.replace("SAMPLES_HERE", str(SAMPLES))


def _flags(machines: list[Any], rank: int) -> list[str]:
    return ["--num_machines", "2", "--machine_rank", str(rank), "--num_processes", "4", "--replica_groups", "4",
            "--main_process_ip", machines[0].ip, "--main_process_port", str(PORT), "--step_timeout", "5",
            "--quorum_timeout", "120", "--min_replicas", "4"]


def _env(tag: str, out: Path) -> dict[str, str]:
    env = launch_env(tag, {"FT_OUT": str(out), "OMP_NUM_THREADS": "1", "TMPDIR": str(out),
                           "HASTEN_HOME": str(out / "home")})
    env.pop("GLOO_SOCKET_IFNAME", None)  # each machine's launcher finds its own interface
    return env


@pytest.fixture(scope="module")
def two_machines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Dry runs on both machines, then the run itself; their outputs and the output folder."""
    if _WHY_NOT is not None:
        pytest.skip(f"simulated machines unavailable: {_WHY_NOT}")
    out = tmp_path_factory.mktemp("machines")
    script = out / "train.py"
    script.write_text(TRAIN)
    tag = new_tag()
    with simulated_machines(2, tag=f"rg{os.getpid() % 10000}") as machines:
        dry = [subprocess.run(machine.command([*launch_argv(*_flags(machines, rank), "--dry_run"), str(script)]),
                              env=_env(tag, out), capture_output=True, text=True, timeout=120)
               for rank, machine in enumerate(machines)]
        procs = [machine.popen([*launch_argv(*_flags(machines, rank)), str(script)], env=_env(tag, out),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                 for rank, machine in enumerate(machines)]
        runs = finish(procs, tag, timeout=300)
        ips = [machine.ip for machine in machines]
    return {"out": out, "dry": dry, "runs": runs, "ips": ips}


def _finals(out: Path) -> dict[int, dict[str, Any]]:
    return {int(path.name.split("_")[1][1:]): json.loads(path.read_text()) for path in out.glob("final_g*_r0.json")}


@needs_netns
def test_every_machine_runs_its_groups_and_the_weights_end_bit_equal(two_machines: dict[str, Any]) -> None:
    out, runs, ips = two_machines["out"], two_machines["runs"], two_machines["ips"]
    assert [code for code, _ in runs] == [0, 0], "\n".join(output[-3000:] for _, output in runs)
    finals = _finals(out)
    assert sorted(finals) == [0, 1, 2, 3], runs[1][1][-3000:]
    for group, final in finals.items():  # groups 0-1 on machine 0, 2-3 on machine 1, stores on their machine
        assert final["store"] == ips[group // 2], (group, final)
        assert final["lighthouse"] == f"http://{ips[0]}:{PORT}"
    assert len({final["digest"] for final in finals.values()}) == 1
    assert len({final["step"] for final in finals.values()}) == 1
    for group in range(4):  # every group took part in committed steps
        rows = [json.loads(line) for line in (out / f"steps_g{group}_r0.jsonl").read_text().splitlines()]
        assert sum(row["committed"] for row in rows) >= SAMPLES // (4 * 4) - 1, (group, rows)


@needs_netns
def test_the_epoch_sees_every_sample_once_over_the_machines(two_machines: dict[str, Any]) -> None:
    out, runs = two_machines["out"], two_machines["runs"]
    assert [code for code, _ in runs] == [0, 0], "\n".join(output[-3000:] for _, output in runs)
    counts: collections.Counter[int] = collections.Counter()
    for path in out.glob("steps_*.jsonl"):
        for row in map(json.loads, path.read_text().splitlines()):
            if row["committed"] and not row["padded"]:
                counts.update(row["ids"])
    assert sorted(counts) == list(range(SAMPLES)), sorted(set(range(SAMPLES)) - set(counts))
    assert set(counts.values()) == {1}, [i for i, n in counts.items() if n > 1]


@needs_netns
def test_dry_run_shows_each_machines_groups_and_the_lighthouse(two_machines: dict[str, Any]) -> None:
    dry, ips = two_machines["dry"], two_machines["ips"]
    for rank, proc in enumerate(dry):
        assert proc.returncode == 0, proc.stderr
        assert f"this machine ({rank}) runs groups {2 * rank}, {2 * rank + 1}" in proc.stderr, proc.stderr
        assert "4 replica groups of 1 process(es) over 2 machines, 2 per machine" in proc.stderr
        assert f"TORCHFT_LIGHTHOUSE=http://{ips[0]}:{PORT}" in proc.stdout, proc.stdout
        assert "launcher:      replica-groups" in proc.stdout
    assert "started on this machine (machine 0)" in dry[0].stderr and "on machine 0" in dry[1].stderr


def test_a_group_spanning_machines_is_refused_with_the_values_and_the_fix(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    proc = subprocess.run([sys.executable, "-m", "hasten.commands.main", "launch", "--cpu", "--num_machines", "2",
                           "--machine_rank", "1", "--num_processes", "6", "--replica_groups", "3",
                           "--main_process_ip", "127.0.0.1", "--main_process_port", "29531", "--dry_run",
                           str(script)], env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--replica_groups=3 over --num_machines=2" in proc.stderr, proc.stderr
    assert "3 is not a multiple of 2" in proc.stderr
    assert "pass --replica_groups 2 or 6" in proc.stderr


def test_min_replicas_above_the_groups_is_refused(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    proc = subprocess.run([sys.executable, "-m", "hasten.commands.main", "launch", "--cpu", "--num_processes", "2",
                           "--replica_groups", "2", "--min_replicas", "3", "--dry_run", str(script)],
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--min_replicas=3 is more than --replica_groups=2" in proc.stderr, proc.stderr
