"""SLURM: processes started by ``srun`` (one task per process)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from hasten.environments.base import ClusterEnvironment, ProcessInfo, check_ranks, read_int
from hasten.exceptions import ConfigurationError


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a SLURM host list such as ``"gpu[01-03,07],cpu-a"`` into host names.

    Example:
        >>> expand_hostlist("n[1-2],m")
        ['n1', 'n2', 'm']
    """
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", hostlist):
        match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if not match:
            hosts.append(part)
            continue
        prefix, ranges, suffix = match.groups()
        for item in ranges.split(","):
            if "-" in item:
                lo, hi = item.split("-", 1)
                width = len(lo)
                hosts.extend(f"{prefix}{i:0{width}d}{suffix}" for i in range(int(lo), int(hi) + 1))
            else:
                hosts.append(f"{prefix}{item}{suffix}")
    return hosts


def _tasks_on_first_node(value: str) -> int:
    # SLURM_TASKS_PER_NODE looks like "2(x3),1": two tasks on each of three nodes, then one.
    match = re.match(r"(\d+)", value)
    if not match:
        raise ConfigurationError(f"SLURM environment: cannot parse SLURM_TASKS_PER_NODE={value!r}")
    return int(match.group(1))


def default_port_for_job(job_id: str) -> int:
    """A port derived from the job id, so every task of a job agrees on it without talking."""
    digits = re.sub(r"\D", "", job_id) or "0"
    return 12000 + int(digits) % 20000


class SLURMEnvironment(ClusterEnvironment):
    """Tasks of a job step started by ``srun``.

    The batch script itself (``sbatch``) has no step id and is not treated as a task, so
    ``hasten launch`` inside it starts its own processes instead of waiting for missing peers.
    """

    name = "slurm"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        has_step = "SLURM_STEP_ID" in env or "SLURM_STEPID" in env
        return "SLURM_PROCID" in env and "SLURM_NTASKS" in env and has_step

    def process_info(self, env: Mapping[str, str]) -> ProcessInfo:
        src = "SLURM environment"
        world = read_int(env, "SLURM_NTASKS", src)
        if env.get("SLURM_NTASKS_PER_NODE"):
            local_world = read_int(env, "SLURM_NTASKS_PER_NODE", src)
        elif env.get("SLURM_TASKS_PER_NODE"):
            local_world = _tasks_on_first_node(env["SLURM_TASKS_PER_NODE"])
        else:
            local_world = world
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        master_addr = env.get("MASTER_ADDR") or (expand_hostlist(nodelist)[0] if nodelist else "127.0.0.1")
        port_default = default_port_for_job(env.get("SLURM_JOB_ID", env.get("SLURM_JOBID", "0")))
        info = ProcessInfo(
            rank=read_int(env, "SLURM_PROCID", src),
            local_rank=read_int(env, "SLURM_LOCALID", src, default=0),
            world_size=world,
            local_world_size=local_world,
            node_rank=read_int(env, "SLURM_NODEID", src, default=0),
            master_addr=master_addr,
            master_port=read_int(env, "MASTER_PORT", src, default=port_default),
        )
        return check_ranks(info, src)


def requeue_job(env: Mapping[str, str], run: Any = None) -> str | None:
    """Requeue this SLURM job after a preemption checkpoint (``scontrol requeue $SLURM_JOB_ID``).

    Outside SLURM (no ``SLURM_JOB_ID``) nothing happens and None is returned. A job that does not allow
    it (``Requeue=0`` in ``scontrol show job``: submit with ``--requeue``) is left alone; the returned
    line says what happened either way. ``run`` is ``subprocess.run`` (replaced in tests).

    Example:
        >>> requeue_job({}) is None
        True
    """
    job = env.get("SLURM_JOB_ID")
    if not job:
        return None
    if run is None:
        import subprocess

        run = subprocess.run
    try:
        shown = run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30)
        if shown.returncode == 0 and re.search(r"\bRequeue=0\b", shown.stdout):
            return (f"SLURM job {job} does not allow requeueing (Requeue=0); resubmit it to resume from the "
                    "checkpoint. HINT: sbatch --requeue")
        done = run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=30)
    except (OSError, ValueError) as exc:
        return f"could not requeue SLURM job {job}: {exc}"
    except Exception as exc:  # noqa: BLE001 - subprocess.TimeoutExpired: the controller did not answer
        return f"could not requeue SLURM job {job}: {type(exc).__name__}: {exc}"
    if done.returncode != 0:
        why = (done.stderr or done.stdout or "").strip() or f"exit code {done.returncode}"
        return f"SLURM refused to requeue job {job}: {why}"
    return f"SLURM job {job} requeued; it resumes from the checkpoint when it starts again"
