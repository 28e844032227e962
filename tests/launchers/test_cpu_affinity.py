"""``--enable_cpu_affinity``: each local rank is pinned to its own share of the cores, or the option is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hasten.config.schema import LaunchConfig
from hasten.exceptions import ConfigurationError
from hasten.launchers.affinity import cores_for_local_rank, cpu_share, parse_cpulist
from hasten.launchers.plan import LaunchOptions, build_plan

linux_only = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="sched_setaffinity is Linux-only")


def test_cpu_share_splits_cores_into_disjoint_contiguous_parts():
    cores = [0, 1, 2, 3, 8, 9, 10]
    shares = [cpu_share(cores, i, 3) for i in range(3)]
    assert shares == [[0, 1, 2], [3, 8], [9, 10]]
    assert sorted(c for share in shares for c in share) == cores
    assert [cpu_share([4, 5], i, 3) for i in range(3)] == [[4], [5], [4]]  # fewer cores than ranks: shared
    assert parse_cpulist("0-2,8,10-11\n") == [0, 1, 2, 8, 10, 11]


def test_gpu_rank_gets_its_numa_node_cores(tmp_path, monkeypatch):
    # Two GPUs on node 1, one on node 0; node 1 has cores 4-7: the two ranks there split them.
    import torch

    from hasten.launchers import affinity

    for node, cpus in ((0, "0-3"), (1, "4-7")):
        folder = tmp_path / "devices" / "system" / "node" / f"node{node}"
        folder.mkdir(parents=True)
        (folder / "cpulist").write_text(cpus)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(affinity, "gpu_numa_nodes", lambda count, root: [1, 0, 1][:count])
    config = LaunchConfig(distributed_type="MULTI_GPU", enable_cpu_affinity=True)
    allowed = list(range(8))
    assert [cores_for_local_rank(config, r, 3, allowed, tmp_path) for r in range(3)] == [[4, 5], [0, 1, 2, 3],
                                                                                         [6, 7]]
    monkeypatch.setattr(affinity, "gpu_numa_nodes", lambda count, root: [None] * count)  # unknown: CPU split
    assert cores_for_local_rank(config, 1, 2, allowed, tmp_path) == [4, 5, 6, 7]


def test_affinity_is_refused_where_it_cannot_work(tmp_path, monkeypatch):
    script = tmp_path / "s.py"
    script.write_text("")
    config = LaunchConfig(use_cpu=True, num_processes=2, enable_cpu_affinity=True)
    with pytest.raises(ConfigurationError, match="--no_python"):
        build_plan(config, LaunchOptions(script=str(script), no_python=True), {}, device_count=0)
    monkeypatch.delattr(os, "sched_setaffinity", raising=False)
    with pytest.raises(ConfigurationError, match="needs Linux"):
        build_plan(config, LaunchOptions(script=str(script)), {}, device_count=0)


PROBE = """
import json, os, sys
from hasten import PartialState
state = PartialState()
with open(os.path.join(sys.argv[1], f"rank{state.local_process_index}.json"), "w") as out:
    json.dump(sorted(os.sched_getaffinity(0)), out)
"""


@linux_only
@pytest.mark.launch
def test_launched_workers_are_pinned_to_their_share(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", HASTEN_HOME=str(tmp_path / "home"),
               TMPDIR=str(tmp_path))
    env.pop("HASTEN_LAUNCH_CONFIG", None)
    proc = subprocess.run([sys.executable, "-m", "hasten.commands.main", "launch", "--cpu", "--num_processes", "2",
                           "--enable_cpu_affinity", str(tmp_path / "probe.py"), str(tmp_path)], cwd=tmp_path, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout
    allowed = sorted(os.sched_getaffinity(0))  # the launcher's cores are what the workers inherit
    seen = [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(2)]
    assert seen == [cpu_share(allowed, r, 2) for r in range(2)]
    if len(allowed) >= 2:
        assert not set(seen[0]) & set(seen[1]) and set(seen[0]) | set(seen[1]) == set(allowed)
