"""Environment detection: pure functions of an env mapping, one table per scheduler."""

import pytest

from hasten.environments import detect_process_info, expand_hostlist
from hasten.exceptions import ConfigurationError

CASES = [
    ("local", {}, dict(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0)),
    ("torchelastic",
     {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
      "MASTER_ADDR": "node0", "MASTER_PORT": "1234"},
     dict(rank=3, local_rank=1, world_size=4, local_world_size=2, node_rank=1, master_addr="node0", master_port=1234)),
    ("openmpi",
     {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "MASTER_ADDR": "10.0.0.1"},
     dict(rank=5, local_rank=1, world_size=8, local_world_size=4, node_rank=1, master_addr="10.0.0.1", master_port=29500)),
    ("mpich",
     {"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "3"},
     dict(rank=2, local_rank=2, world_size=3, local_world_size=3, node_rank=0, master_addr="127.0.0.1")),
    ("mvapich",
     {"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "2", "MV2_COMM_WORLD_LOCAL_RANK": "1",
      "MV2_COMM_WORLD_LOCAL_SIZE": "2"},
     dict(rank=1, local_rank=1, world_size=2, local_world_size=2, node_rank=0)),
    ("slurm",
     {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
      "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "4242",
      "SLURM_JOB_NODELIST": "gpu[07-08]"},
     dict(rank=5, local_rank=1, world_size=8, local_world_size=4, node_rank=1, master_addr="gpu07",
          master_port=12000 + 4242)),
    ("kubeflow",
     {"RANK": "1", "WORLD_SIZE": "3", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"},
     dict(rank=1, local_rank=0, world_size=3, local_world_size=1, node_rank=1, master_addr="job-master-0")),
]


@pytest.mark.parametrize("name,env,expected", CASES, ids=[c[0] for c in CASES])
def test_detection_table(name, env, expected):
    environment, info = detect_process_info(env)
    assert environment.name == name
    for key, value in expected.items():
        assert getattr(info, key) == value, key


def test_torchrun_wins_over_slurm_and_mpi():
    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
           "SLURM_STEP_ID": "0", "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}
    environment, info = detect_process_info(env)
    assert environment.name == "torchelastic" and info.world_size == 2


def test_sbatch_script_is_not_a_task():
    # The batch step has no step id: hasten launch inside it must start its own processes.
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "1"}
    environment, info = detect_process_info(env)
    assert environment.name == "local" and info.world_size == 1


@pytest.mark.parametrize("hostlist,expected", [
    ("node1", ["node1"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("gpu[007-009,012],cpu-a", ["gpu007", "gpu008", "gpu009", "gpu012", "cpu-a"]),
    ("a[1-2]-ib,b", ["a1-ib", "a2-ib", "b"]),
])
def test_expand_hostlist(hostlist, expected):
    assert expand_hostlist(hostlist) == expected


@pytest.mark.parametrize("env,fragment", [
    ({"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}, "rank 2 is outside"),
    ({"RANK": "x", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "0"}, "world size 0"),
])
def test_bad_variables_are_named(env, fragment):
    with pytest.raises(ConfigurationError, match=fragment):
        detect_process_info(env)
