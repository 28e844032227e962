"""Kubeflow Trainer v2 (``PET_*``) and SkyPilot (``SKYPILOT_*``): detection from fake environments, the launch
plan they give ``hasten launch`` with no flags, and two namespaced "pods" that form the world from them alone."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import hasten.testing
from hasten.config.schema import LaunchConfig
from hasten.environments import detect_machine_layout, detect_process_info
from hasten.exceptions import ConfigurationError
from hasten.launchers.plan import LaunchOptions, build_plan
from hasten.testing.netns import netns_unavailable, simulated_machines

PET = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "job-node-0-0.job",
       "PET_MASTER_PORT": "29400"}
SKY = {"SKYPILOT_NODE_IPS": "10.1.0.4\n10.1.0.5\n10.1.0.6\n", "SKYPILOT_NUM_NODES": "3", "SKYPILOT_NODE_RANK": "2",
       "SKYPILOT_NUM_GPUS_PER_NODE": "0"}


# ---------------------------------------------------------------------------------------------- detection
def test_kubeflow_trainer_layout():
    layout = detect_machine_layout(PET)
    assert (layout.source, layout.num_machines, layout.machine_rank, layout.main_process_ip,
            layout.main_process_port, layout.processes_per_machine) == \
        ("Kubeflow Trainer", 2, 1, "job-node-0-0.job", 29400, 2)


@pytest.mark.parametrize(("nproc", "expected"), [("auto", None), ("gpu", None), ("", None), ("8", 8)])
def test_kubeflow_trainer_processes_per_node(nproc, expected):
    assert detect_machine_layout({**PET, "PET_NPROC_PER_NODE": nproc}).processes_per_machine == expected


def test_skypilot_layout_head_node_is_the_first_address():
    layout = detect_machine_layout(SKY)
    assert (layout.source, layout.num_machines, layout.machine_rank, layout.main_process_ip,
            layout.main_process_port, layout.processes_per_machine) == ("SkyPilot", 3, 2, "10.1.0.4", None, None)
    with_gpus = detect_machine_layout({**SKY, "SKYPILOT_NUM_GPUS_PER_NODE": "4", "MASTER_PORT": "8008"})
    assert with_gpus.processes_per_machine == 4 and with_gpus.main_process_port == 8008


def test_no_cluster_variables_no_layout():
    assert detect_machine_layout({"RANK": "0", "WORLD_SIZE": "1"}) is None
    # PyTorchJob (Trainer v1) with an elastic policy sets PET_NNODES but no node rank: not Trainer v2.
    assert detect_machine_layout({"PET_NNODES": "1:4", "PET_RDZV_BACKEND": "c10d"}) is None


BAD = [
    ({**PET, "PET_NODE_RANK": "2"}, "PET_NODE_RANK='2' is not below PET_NNODES=2"),
    ({**PET, "PET_NODE_RANK": "-1"}, "PET_NODE_RANK='-1' must be at least 0"),
    ({**PET, "PET_NNODES": "two"}, "PET_NNODES='two' is not an integer"),
    ({**PET, "PET_NNODES": "1:4"}, "PET_NNODES='1:4' is not an integer"),
    ({**PET, "PET_NNODES": "0"}, "PET_NNODES='0' must be at least 1"),
    ({**PET, "PET_NPROC_PER_NODE": "0"}, "PET_NPROC_PER_NODE='0' must be at least 1"),
    ({**PET, "PET_NPROC_PER_NODE": "cpu"}, "PET_NPROC_PER_NODE='cpu' is not an integer"),
    ({**PET, "PET_MASTER_ADDR": ""}, "PET_MASTER_ADDR is not set"),
    ({**PET, "PET_MASTER_PORT": "99999"}, "PET_MASTER_PORT='99999' is not a TCP port"),
    ({**PET, "PET_MASTER_PORT": "x"}, "PET_MASTER_PORT='x' is not an integer"),
    ({**SKY, "SKYPILOT_NUM_NODES": "2"}, r"SKYPILOT_NODE_IPS lists 3 addresses \(10.1.0.4, 10.1.0.5, 10.1.0.6\) but "
                                         "SKYPILOT_NUM_NODES=2"),
    ({**SKY, "SKYPILOT_NODE_RANK": "3"}, "SKYPILOT_NODE_RANK='3' is not below SKYPILOT_NUM_NODES=3"),
    ({**SKY, "SKYPILOT_NODE_RANK": "one"}, "SKYPILOT_NODE_RANK='one' is not an integer"),
    ({**SKY, "SKYPILOT_NUM_NODES": "x"}, "SKYPILOT_NUM_NODES='x' is not an integer"),
    ({**SKY, "SKYPILOT_NUM_GPUS_PER_NODE": "-1"}, "SKYPILOT_NUM_GPUS_PER_NODE='-1' is not a number of GPUs"),
    ({"SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_RANK": "0"}, "SKYPILOT_NODE_IPS is not set but SKYPILOT_NUM_NODES=2"),
]


@pytest.mark.parametrize(("env", "message"), BAD, ids=[m[:40] for _, m in BAD])
def test_inconsistent_values_are_refused_naming_the_variable(env, message):
    with pytest.raises(ConfigurationError, match=message) as caught:
        detect_machine_layout(env)
    assert "HINT:" in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(ConfigurationError, match=message):  # a bare Accelerator() refuses them too
        detect_process_info(env)


def test_a_process_started_alone_on_its_machine_is_one_rank_per_machine():
    environment, info = detect_process_info({**PET, "PET_NPROC_PER_NODE": "1"})
    assert environment.name == "kubeflow-trainer"
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size, info.master_addr,
            info.master_port) == (1, 2, 0, 1, "job-node-0-0.job", 29400)
    environment, info = detect_process_info(SKY)
    assert environment.name == "skypilot"
    assert (info.rank, info.world_size, info.master_addr, info.master_port) == (2, 3, "10.1.0.4", 29500)


def test_a_lone_process_where_the_pod_should_run_several_is_refused():
    with pytest.raises(ConfigurationError, match="PET_NPROC_PER_NODE=2 processes per machine, but this process was "
                                                 "started on its own"):
        detect_process_info(PET)


def test_torchrun_in_the_pod_describes_the_processes():
    env = {**PET, "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    environment, info = detect_process_info(env)
    assert environment.name == "torchelastic" and info.rank == 3


# ---------------------------------------------------------------------------------------------- launch plan
def _plan(env, config=None, tmp_path=None):
    script = Path(hasten.testing.__file__)
    return build_plan(config or LaunchConfig(), LaunchOptions(script=str(script)), env, device_count=0)


def test_plan_from_pet_variables_alone():
    plan = _plan(PET)
    assert (plan.launcher, plan.nnodes, plan.node_rank, plan.nproc_per_node, plan.master_addr, plan.master_port) == \
        ("torchrun", 2, 1, 2, "job-node-0-0.job", 29400)


def test_plan_from_skypilot_variables_alone_is_one_process_per_cpu_node():
    plan = _plan(SKY)
    assert (plan.nnodes, plan.node_rank, plan.nproc_per_node, plan.master_addr, plan.master_port) == \
        (3, 2, 1, "10.1.0.4", 29500)
    more = _plan(SKY, LaunchConfig(num_processes=6))  # --num_processes is the total over all machines
    assert (more.nnodes, more.nproc_per_node) == (3, 2)
    gpus = build_plan(LaunchConfig(), LaunchOptions(script=str(Path(hasten.testing.__file__))),
                      {**SKY, "SKYPILOT_NUM_GPUS_PER_NODE": "8"}, device_count=8)
    assert (gpus.nproc_per_node, gpus.num_processes) == (8, 24)
    on_cpu = build_plan(LaunchConfig(use_cpu=True), LaunchOptions(script=str(Path(hasten.testing.__file__))),
                        {**SKY, "SKYPILOT_NUM_GPUS_PER_NODE": "8"}, device_count=8)
    assert on_cpu.nproc_per_node == 1  # --cpu: the GPU count does not make 8 CPU processes


def test_plan_keeps_an_explicit_address_and_refuses_contradictions():
    plan = _plan(PET, LaunchConfig(main_process_ip="10.9.9.9", num_processes=4))
    assert plan.master_addr == "10.9.9.9" and plan.num_processes == 4
    with pytest.raises(ConfigurationError, match="num_machines=3 .* contradicts this Kubeflow Trainer machine's "
                                                 "PET_NNODES=2"):
        _plan(PET, LaunchConfig(num_machines=3, machine_rank=1))
    with pytest.raises(ConfigurationError, match="num_processes=6 .* PET_NPROC_PER_NODE=2 x PET_NNODES=2 = 4"):
        _plan(PET, LaunchConfig(num_processes=6))


# ---------------------------------------------------------------------------------------------- two "pods"
_WHY_NOT = netns_unavailable()
needs_netns = pytest.mark.skipif(_WHY_NOT is not None, reason=f"simulated machines unavailable: {_WHY_NOT}")
TRAIN = str(Path(hasten.testing.__file__).parent / "scripts" / "regression_train.py")


def _env(tmp_path, cluster):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "SKYPILOT_", "HASTEN_", "ACCELERATE_"))}
    env.update(OMP_NUM_THREADS="1", HASTEN_HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path), PYTHONUNBUFFERED="1",
               **cluster)
    for key in ("GLOO_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    return env


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The weights one process reaches with the whole global batch (computed once for the module)."""
    ref = tmp_path_factory.mktemp("reference")
    done = subprocess.run([sys.executable, TRAIN, str(ref), "12", "-1"], env=_env(ref, {}), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads((ref / "rank0.json").read_text())["weights"]


def _pods(machines, tmp_path, variables_of):
    (tmp_path / "out").mkdir(exist_ok=True)
    argv = [sys.executable, "-m", "hasten.commands.main", "launch", TRAIN, str(tmp_path / "out"), "12", "-1"]
    procs = [machine.popen(argv, env=_env(tmp_path, variables_of(rank, machines)), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT) for rank, machine in enumerate(machines)]
    outs = []
    for proc in procs:
        try:
            outs.append(proc.communicate(timeout=150)[0])
        except subprocess.TimeoutExpired:
            proc.kill()
            outs.append(proc.communicate()[0])
    return [p.returncode for p in procs], outs


def _pet(rank, machines):  # fixed ports are safe: each test's namespaces are new and hold nothing else
    return {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": str(rank),
            "PET_MASTER_ADDR": machines[0].ip, "PET_MASTER_PORT": "29514"}


def _sky(rank, machines):
    return {"SKYPILOT_NODE_IPS": "\n".join(m.ip for m in machines) + "\n", "SKYPILOT_NUM_NODES": "2",
            "SKYPILOT_NODE_RANK": str(rank), "SKYPILOT_NUM_GPUS_PER_NODE": "0", "MASTER_PORT": "29515"}


@pytest.mark.launch
@needs_netns
@pytest.mark.parametrize(("variables_of", "world"), [(_pet, 4), (_sky, 2)], ids=["kubeflow-trainer", "skypilot"])
def test_two_pods_form_the_world_from_cluster_variables_alone(tmp_path, reference, variables_of, world):
    with simulated_machines(2) as machines:
        codes, outs = _pods(machines, tmp_path, variables_of)
    assert codes == [0, 0], "\n".join(outs)
    results = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in range(world)]
    assert all(r["world"] == world for r in results)
    for r in results:  # the same weights as one process with the whole batch: the world really formed
        assert r["weights"] == pytest.approx(reference, abs=1e-5)


@pytest.mark.launch
@needs_netns
@pytest.mark.parametrize(("variables_of", "wrong", "message"), [
    (_pet, {"PET_NODE_RANK": "2"}, "PET_NODE_RANK='2' is not below PET_NNODES=2"),
    (_sky, {"SKYPILOT_NUM_NODES": "3"}, "SKYPILOT_NODE_IPS lists 2 addresses"),
], ids=["kubeflow-trainer", "skypilot"])
def test_a_wrong_cluster_variable_is_refused_at_once(tmp_path, variables_of, wrong, message):
    with simulated_machines(2) as machines:
        start = time.monotonic()
        proc = machines[1].popen([sys.executable, "-m", "hasten.commands.main", "launch", TRAIN,
                                  str(tmp_path / "out"), "12", "-1"],
                                 env=_env(tmp_path, {**variables_of(1, machines), **wrong}), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT)
        out, _ = proc.communicate(timeout=60)
        elapsed = time.monotonic() - start
    assert proc.returncode == 2, out
    assert message in out and "HINT:" in out, out
    assert elapsed < 10, f"refused after {elapsed:.1f} s"
