"""``hasten launch --num_machines MIN:MAX``: machines that leave or join (torchrun's c10d agent), on namespaced machines.

Three machines under ``2:3``; one is killed mid-run: the two others restart their worker group on the
remaining machines, which resumes from the newest checkpoint on 2 processes instead of 3 (one per
machine: each worker's start-up is most of the cost) and ends with exactly the weights of the same
script resumed from that checkpoint on 2 processes; each membership change is one log line, and the
checkpoint resumed one more. A machine started late joins at the next restart.
"""

import json
import os
import runpy
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch

from hasten.checkpointing import checkpoints_root, newest_checkpoint
from hasten.testing import run_on_ranks
from hasten.testing.netns import netns_unavailable, simulated_machines

pytestmark = [pytest.mark.launch]
_WHY_NOT = netns_unavailable()
needs_netns = pytest.mark.skipif(_WHY_NOT is not None, reason=f"simulated machines unavailable: {_WHY_NOT}")

# An ordinary resumable script: it loads the newest checkpoint of its project folder when there is one,
# keeps the global batch whatever the number of processes, and saves every 2 steps. On 3 processes it
# stops after step 5 (one step past the newest checkpoint) until the test has killed a machine.
SCRIPT = """
import os, sys, time
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from hasten import Accelerator, ProjectConfiguration
from hasten.checkpointing import newest_checkpoint
from hasten.utils import set_seed

GLOBAL_BATCH, SAMPLES, EPOCHS = 12, 72, 2  # 6 optimizer steps per epoch, on 2 or 3 processes


class Progress:
    def __init__(self): self.step = 0
    def state_dict(self): return {"step": self.step}
    def load_state_dict(self, state): self.step = state["step"]


def main(project, output, gate):
    config = ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True)
    accelerator = Accelerator(cpu=True, project_config=config)
    world = accelerator.num_processes
    set_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    x = torch.randn(SAMPLES, 6, generator=torch.Generator().manual_seed(3))
    loader = DataLoader(TensorDataset(x, torch.sin(x.sum(1, keepdim=True))), batch_size=GLOBAL_BATCH // world,
                        shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if newest_checkpoint(project) is not None:
        accelerator.load_state()
    for _ in range(loader.state_dict()["epoch"], EPOCHS):
        for xb, yb in loader:
            accelerator.backward(nn.functional.mse_loss(model(xb), yb))
            optimizer.step()
            optimizer.zero_grad()
            progress.step += 1
            if progress.step % 2 == 0:
                accelerator.save_state()
            if world == 3 and progress.step == 5:
                open(os.path.join(gate, f"ready{accelerator.process_index}"), "w").close()
                deadline = time.monotonic() + 120
                while not os.path.exists(os.path.join(gate, "go")) and time.monotonic() < deadline:
                    time.sleep(0.05)
    if accelerator.is_main_process:
        torch.save({"step": progress.step, "weights": accelerator.get_state_dict(model)}, output)
    accelerator.end_training()


if __name__ == "__main__":
    main(*sys.argv[1:4])
"""


def _env(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", HASTEN_HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path),
               PYTHONUNBUFFERED="1")
    env.pop("GLOO_SOCKET_IFNAME", None)
    return env


def _wait_for(paths, procs, timeout=180):
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert all(proc.poll() is None for proc in procs), "a launcher ended before the workers were ready"
        assert time.monotonic() < deadline, "the workers did not get ready"
        time.sleep(0.1)


class _Lines:
    """A launcher's output, read as it comes (a thread), so that the test can wait for one line."""

    def __init__(self, proc):
        self.proc, self.lines, self.changed = proc, [], threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            with self.changed:
                self.lines.append(line.rstrip("\n"))
                self.changed.notify_all()
        with self.changed:
            self.lines.append("")  # end of output
            self.changed.notify_all()

    def wait_for(self, text, timeout=120):
        with self.changed:
            assert self.changed.wait_for(lambda: any(text in line for line in self.lines), timeout), self.text()

    def finish(self, timeout):
        self.proc.wait(timeout=timeout)
        self.reader.join(timeout=30)
        return self.text()

    def text(self):
        return "\n".join(self.lines)


def _resume_in_rank(script, project, output):
    torch.set_num_threads(1)  # as the launched workers (OMP_NUM_THREADS=1): the same float reductions
    runpy.run_path(script)["main"](project, output, "-")


@needs_netns
def test_a_killed_machine_leaves_and_the_others_resume_the_newest_checkpoint_exactly(tmp_path):
    script, project, gate, weights = tmp_path / "elastic.py", tmp_path / "run", tmp_path / "gate", tmp_path / "w.pt"
    script.write_text(SCRIPT)
    gate.mkdir()
    with simulated_machines(3) as machines:
        procs, watched = [None, None, None], [None, None, None]
        # Machines 2 and 1 first, machine 0 (the rendezvous host) once they wait for it: all three then join
        # the first round within a second, whatever the load (a round forms 2 s after MIN machines are in).
        try:
            for rank in (2, 1, 0):
                argv = [sys.executable, "-m", "hasten.commands.main", "launch", "--cpu", "--num_machines", "2:3",
                        "--machine_rank", str(rank), "--num_processes", "3", "--main_process_ip", machines[0].ip,
                        "--main_process_port", "29531", "--rdzv_conf",
                        "join_timeout=90,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3",
                        str(script), str(project), str(weights), str(gate)]
                procs[rank] = machines[rank].popen(argv, env=_env(tmp_path), stdout=subprocess.PIPE,
                                                   stderr=subprocess.STDOUT)
                watched[rank] = _Lines(procs[rank])
                if rank:
                    watched[rank].wait_for("hasten launch: checking the network")
            started = time.monotonic()
            _wait_for([gate / f"ready{r}" for r in range(3)], procs)
            ready = time.monotonic()
            newest = newest_checkpoint(project)  # what the 2 remaining machines must resume
            assert newest is not None and newest.name == "checkpoint_1"  # saved after step 4 of 5
            shutil.copytree(newest, checkpoints_root(tmp_path / "reference") / newest.name)
            machines[2].kill()  # the machine dies, with its launcher and workers
            (gate / "go").touch()
            outs = [lines.finish(timeout=240) for lines in watched[:2]]
            finished = time.monotonic()
        finally:
            for proc in procs:
                if proc is not None:
                    proc.kill()
    text = "\n---\n".join(outs)
    assert [p.returncode for p in procs[:2]] == [0, 0], text
    print(f"MIN:MAX resume: 3 workers at step 5 after {ready - started:.1f} s; the 2 machines left finished "
          f"{finished - ready:.1f} s after the kill")
    for output in outs:
        lines = [line for line in output.splitlines() if line.startswith("hasten launch: ")]
        assert any("3 machines, world size 3" in line for line in lines), output
        left = [line for line in lines if "machines changed:" in line]
        assert len(left) == 1, output
        assert f"({machines[2].ip}) left; the run goes on with 2 machines, world size 2" in left[0], output
    resumed = [line for line in outs[0].splitlines() if "hasten: the restarted worker group" in line]
    assert len(resumed) == 1, outs[0]  # one line, from the main process
    assert f"(restart 1) resumed from checkpoint_1 ({newest}), saved by 3 processes, now 2" in resumed[0]
    # Ground truth: the same script resumed from a copy of that checkpoint on 2 processes of one machine
    # (forked ranks; what they import is imported here once, not in each of them).
    import torch._dynamo  # noqa: F401  (DDP's first use imports it)
    import torch.distributed.fsdp  # noqa: F401

    from hasten.accelerator.core import Accelerator  # noqa: F401

    started = time.monotonic()
    run_on_ranks(_resume_in_rank, world_size=2, args=(str(script), str(tmp_path / "reference"),
                                                       str(tmp_path / "reference.pt")), timeout=120)
    print(f"MIN:MAX resume: the reference resume on 2 forked ranks took {time.monotonic() - started:.1f} s")
    ran, reference = torch.load(weights), torch.load(tmp_path / "reference.pt")
    assert ran["step"] == reference["step"] == 12
    assert ran["weights"].keys() == reference["weights"].keys()
    for key, value in ran["weights"].items():
        assert torch.equal(value, reference["weights"][key]), key


# The first round (2 machines, world size 4) waits after 3 steps; a machine that joins makes the agents
# restart the group (stopping those workers) on 3 machines, which trains to the end.
JOIN_SCRIPT = """
import json, os, sys, time
import torch
import torch.distributed as dist
from hasten import PartialState

out = sys.argv[1]
state = PartialState()
total = torch.zeros(1)
for step in range(6):
    ones = torch.ones(1)
    dist.all_reduce(ones)
    total += ones
    if state.num_processes == 4 and step == 2:
        open(os.path.join(out, f"ready{state.process_index}"), "w").close()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            time.sleep(0.05)
        sys.exit("the joining machine never made the group restart")
with open(os.path.join(out, f"done{state.num_processes}_{state.process_index}.json"), "w") as f:
    json.dump({"world": state.num_processes, "total": total.item()}, f)
"""


@needs_netns
def test_a_machine_started_late_joins_at_the_next_restart(tmp_path):
    script = tmp_path / "join.py"
    script.write_text(JOIN_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    with simulated_machines(3) as machines:
        def start(rank):
            argv = [sys.executable, "-m", "hasten.commands.main", "launch", "--cpu", "--num_machines", "2:3",
                    "--machine_rank", str(rank), "--num_processes", "6", "--main_process_ip", machines[0].ip,
                    "--main_process_port", "29532", "--rdzv_conf", "join_timeout=90,last_call_timeout=2",
                    "--monitor_interval", "0.5", str(script), str(out)]
            return machines[rank].popen(argv, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

        procs = [start(0), start(1)]
        try:
            _wait_for([out / f"ready{r}" for r in range(4)], procs)
            procs.append(start(2))
            outs = [proc.communicate(timeout=240)[0] for proc in procs]
        finally:
            for proc in procs:
                proc.kill()
    text = "\n---\n".join(outs)
    assert [p.returncode for p in procs] == [0, 0, 0], text
    finished = [json.loads((out / f"done6_{r}.json").read_text()) for r in range(6)]
    assert finished == [{"world": 6, "total": 36.0}] * 6, text
    for output in outs[:2]:
        lines = [line for line in output.splitlines() if line.startswith("hasten launch: ")]
        assert any("2 machines, world size 4" in line for line in lines), output
        joined = [line for line in lines if "machines changed:" in line]
        assert len(joined) == 1, output
        assert f"({machines[2].ip}) joined; the run goes on with 3 machines, world size 6" in joined[0], output


def _launch_args(*argv):
    import argparse

    from hasten.commands.launch import build_launch_parser

    return build_launch_parser(argparse.ArgumentParser()).parse_args(list(argv))


def test_min_max_machines_plan_c10d_torchrun_ranges_and_restarts(tmp_path):
    from hasten.commands.launch import options_from_args, resolve_config
    from hasten.launchers.plan import ELASTIC_RESTARTS, build_plan
    from hasten.launchers.torchrun import torchrun_argv

    script = tmp_path / "train.py"
    script.write_text("")
    common = ["--cpu", "--num_processes", "6", "--main_process_ip", "10.0.0.9", "--main_process_port", "29541",
              "--machine_rank", "1"]
    for extra, restarts in (([], ELASTIC_RESTARTS), (["--max_restarts", "1"], 1)):
        args = _launch_args("--num_machines", "2:3", *common, *extra, str(script))
        options = options_from_args(args)
        plan = build_plan(resolve_config(args, {}), options, {}, device_count=0)
        argv = torchrun_argv(plan, options)
        assert argv[argv.index("--nnodes") + 1] == "2:3" and argv[argv.index("--rdzv_backend") + 1] == "c10d"
        assert argv[argv.index("--max_restarts") + 1] == str(restarts)
        assert plan.nproc_per_node == 2 and "4..6 (2 per machine x 2..3 machines" in plan.describe()
    fixed = _launch_args("--num_machines", "3:3", *common, str(script))
    assert build_plan(resolve_config(fixed, {}), options_from_args(fixed), {}, device_count=0).min_nnodes is None


@pytest.mark.parametrize(("value", "message"), [("3:2", "min_machines=3 must be in 1..num_machines=2"),
                                                ("two", "--num_machines 'two' must be a number of machines N or a "
                                                        "range MIN:MAX")])
def test_a_bad_machine_range_is_refused_with_the_fix(capsys, value, message):
    from hasten.commands.launch import launch_command

    args = _launch_args("--cpu", "--num_machines", value, "--main_process_ip", "10.0.0.9", "--dry_run", "x.py")
    assert launch_command(args) == 2
    assert message in capsys.readouterr().err


def test_min_max_machines_in_a_configuration_file(tmp_path):
    from hasten.config.io import load_config_file

    path = tmp_path / "config.yaml"
    path.write_text("distributed_type: MULTI_CPU\nuse_cpu: true\nnum_machines: 4\nmin_machines: 2\n"
                    "num_processes: 8\nmain_process_ip: 10.0.0.9\nrdzv_backend: c10d\n")
    config = load_config_file(path)
    assert (config.min_machines, config.num_machines) == (2, 4)


def test_membership_lines():
    from hasten.launchers.machines.membership import describe_change

    first = describe_change(None, {"a (10.0.0.1)": 2, "b (10.0.0.2)": 2})
    assert first == "2 machines, world size 4: a (10.0.0.1), b (10.0.0.2)"
    assert describe_change({"a": 2}, {"a": 2, "c": 2}) == ("machines changed: c joined; the run goes on with 2 "
                                                           "machines, world size 4")
    assert describe_change({"a": 2, "b": 2}, {"a": 2, "b": 2}) == ("the worker group restarts on the same 2 "
                                                                   "machines, world size 4")
