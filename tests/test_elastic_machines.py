"""``hasten launch --num_machines MIN:MAX``: machines that leave (torchrun's c10d agent), on namespaced machines.

Three machines under ``2:3``; one is killed mid-run: the two others restart their worker group on the
remaining machines and finish, and each membership change is one log line. (Resuming from the newest
checkpoint on the new number of processes is not part of this test yet.)
"""

import json
import os
import subprocess
import sys

import pytest

from hasten.testing.netns import netns_unavailable, simulated_machines

pytestmark = [pytest.mark.launch]
_WHY_NOT = netns_unavailable()
needs_netns = pytest.mark.skipif(_WHY_NOT is not None, reason=f"simulated machines unavailable: {_WHY_NOT}")

# Round 0 (3 machines) stops after 3 steps until the test has killed a machine; the next round trains
# from the start on whatever machines remain (no checkpoint here) and writes what it saw.
SCRIPT = """
import json, os, sys, time
import torch
import torch.distributed as dist
from hasten import PartialState

out = sys.argv[1]
state = PartialState()
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
total = torch.zeros(1)
for step in range(6):
    ones = torch.ones(1)
    dist.all_reduce(ones)
    total += ones
    if restart == 0 and step == 2:
        open(os.path.join(out, f"ready{state.process_index}"), "w").close()
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(out, "go")) and time.monotonic() < deadline:
            time.sleep(0.05)
with open(os.path.join(out, f"done{restart}_{state.process_index}.json"), "w") as f:
    json.dump({"world": state.num_processes, "total": total.item()}, f)
"""


def _env(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", HASTEN_HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path),
               PYTHONUNBUFFERED="1")
    env.pop("GLOO_SOCKET_IFNAME", None)
    return env


def _wait_for(paths, procs, timeout=180):
    import time

    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert all(proc.poll() is None for proc in procs), "a launcher ended before the workers were ready"
        assert time.monotonic() < deadline, "the workers did not get ready"
        time.sleep(0.1)


@needs_netns
def test_a_killed_machine_leaves_and_the_others_go_on_under_min_max(tmp_path):
    script = tmp_path / "elastic.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    with simulated_machines(3) as machines:
        procs = []
        for rank, machine in enumerate(machines):
            argv = [sys.executable, "-m", "hasten.commands.main", "launch", "--cpu", "--num_machines", "2:3",
                    "--machine_rank", str(rank), "--num_processes", "6", "--main_process_ip", machines[0].ip,
                    "--main_process_port", "29531", "--rdzv_conf",
                    "join_timeout=90,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3",
                    str(script), str(out)]
            procs.append(machine.popen(argv, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        try:
            _wait_for([out / f"ready{r}" for r in range(6)], procs)
            machines[2].kill()  # the machine dies, with its launcher and workers
            (out / "go").touch()
            outs = []
            for proc in procs[:2]:
                outs.append(proc.communicate(timeout=240)[0])
        finally:
            for proc in procs:
                proc.kill()
    text = "\n---\n".join(outs)
    assert [p.returncode for p in procs[:2]] == [0, 0], text
    finished = [json.loads((out / f"done1_{r}.json").read_text()) for r in range(4)]
    assert finished == [{"world": 4, "total": 24.0}] * 4, text  # a restarted round on 2 machines ran to the end
    assert not list(out.glob("done0_*")), text  # the first round did not finish
    for output in outs:
        lines = [line for line in output.splitlines() if line.startswith("hasten launch: ")]
        assert any("3 machines, world size 6" in line for line in lines), output
        left = [line for line in lines if "machines changed:" in line]
        assert len(left) == 1, output
        assert f"({machines[2].ip}) left; the run goes on with 2 machines, world size 4" in left[0], output


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
    from hasten.launchers.elastic import describe_change

    first = describe_change(None, {"a (10.0.0.1)": 2, "b (10.0.0.2)": 2})
    assert first == "2 machines, world size 4: a (10.0.0.1), b (10.0.0.2)"
    assert describe_change({"a": 2}, {"a": 2, "c": 2}) == ("machines changed: c joined; the run goes on with 2 "
                                                           "machines, world size 4")
    assert describe_change({"a": 2, "b": 2}, {"a": 2, "b": 2}) == ("the worker group restarts on the same 2 "
                                                                   "machines, world size 4")
