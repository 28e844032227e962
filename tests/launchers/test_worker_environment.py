"""``hasten launch --dry_run`` lists every variable a worker receives, besides torchrun's own.

Ground truth: the environment a launched worker really has, compared with the launcher's own environment.
Whatever the worker gets that the launcher did not have must be torchrun's (``RANK``, ``TORCHELASTIC_*``...)
or printed by ``--dry_run`` for the same command line, with the same value (the rendezvous port, and the
values that carry it or a fresh folder, are chosen anew per launch, so only their names are compared).
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.launch]

#: What torchrun's agent sets for every worker itself (``torch.distributed.run``), not hasten's plan.
TORCHRUN_OWN = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME",
                "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RESTART_COUNT",
                "TORCHELASTIC_RUN_ID", "TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCHELASTIC_USE_AGENT_STORE"}
#: Values chosen anew by each launch (a free port, or a fresh folder).
PER_LAUNCH = {"HASTEN_LAUNCH_CONFIG", "HASTEN_PREEMPTION_DIR"}

DUMP = """
import json, os, sys
from pathlib import Path
Path(sys.argv[1], os.environ["RANK"] + ".json").write_text(json.dumps(dict(os.environ)))
"""


def _dry_run_variables(out: str) -> dict[str, str]:
    lines = out.split("worker environment", 1)[1].splitlines()[1:]
    return dict(line.strip().split("=", 1) for line in lines if line.startswith("  ") and "=" in line)


@pytest.mark.parametrize("extra", [[], ["--rdzv_backend", "c10d"]], ids=["static", "c10d"])
def test_dry_run_lists_every_variable_a_worker_receives(tmp_path, extra):
    script = tmp_path / "dump.py"
    script.write_text(DUMP)
    env = dict(os.environ, OMP_NUM_THREADS="1", HASTEN_HOME=str(tmp_path / "home"))
    env.pop("GLOO_SOCKET_IFNAME", None)  # the launcher chooses the interface itself
    argv = [sys.executable, "-m", "hasten.commands.main", "launch", "--cpu", "--num_processes", "2", *extra]
    dry = subprocess.run([*argv, "--dry_run", str(script), str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert dry.returncode == 0, dry.stderr
    planned = _dry_run_variables(dry.stdout)
    run = subprocess.run([*argv, str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    for rank in (0, 1):
        worker = json.loads((tmp_path / f"{rank}.json").read_text())
        added = {k: v for k, v in worker.items() if env.get(k) != v and k not in TORCHRUN_OWN and k != "_"}
        assert sorted(set(added) - set(planned)) == [], dry.stdout
        assert {k: v for k, v in added.items() if k not in PER_LAUNCH} == \
               {k: v for k, v in planned.items() if k not in PER_LAUNCH}
        assert "GLOO_SOCKET_IFNAME" in added and (("TORCH_DISABLE_SHARE_RDZV_TCP_STORE" in added) == bool(extra))
