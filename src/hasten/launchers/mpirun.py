"""Wrapping the workers in ``mpirun`` (OpenMPI, Intel MPI or MPICH).

MPI starts the processes and tells each its rank; the workers meet at ``MASTER_ADDR:MASTER_PORT``
(``PartialState`` reads the MPI variables through ``hasten.environments``).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterable, Mapping
from typing import Any

from hasten.exceptions import LaunchError


def mpi_worker_store(env: Mapping[str, str]) -> Any:
    """Under ``mpirun``, in MPI rank 0: host the process group's store on ``MASTER_ADDR`` only.

    torch's ``init_process_group`` would otherwise open it on every interface; it reuses this one
    (``multi_tenant``). Returns the store to keep alive, or None (not MPI, one process, another rank, or
    an address of another machine). Runs before the script, so ``RANK`` is not exported yet.
    """
    if "RANK" in env or "TORCHELASTIC_RUN_ID" in env:
        return None  # torchrun's workers: hasten.launchers.network handles those
    from hasten.environments import detect_process_info
    from hasten.launchers.network import bind_worker_store

    environment, info = detect_process_info(env)
    if environment.name not in ("openmpi", "mpich", "mvapich") or info.world_size < 2 or info.rank != 0:
        return None
    return bind_worker_store({**env, "RANK": "0", "TORCHELASTIC_USE_AGENT_STORE": "False",
                              "MASTER_ADDR": info.master_addr, "MASTER_PORT": str(info.master_port)})


def find_mpirun() -> str:
    """Path of ``mpirun`` (or ``mpiexec``).

    Raises:
        LaunchError: neither is installed.
    """
    for name in ("mpirun", "mpiexec"):
        path = shutil.which(name)
        if path:
            return path
    raise LaunchError("MPI launch requested (--use_mpi or mpirun_config.mpirun_hostfile) but no `mpirun` was "
                      "found on PATH. HINT: install OpenMPI (apt-get install openmpi-bin) or drop the MPI settings "
                      "to use hasten's torchrun launcher.")


def mpi_flavour(mpirun: str) -> str:
    """``"openmpi"``, ``"intel"`` or ``"mpich"``, from ``mpirun --version``."""
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30)
        text = (out.stdout + out.stderr).lower()
    except (OSError, subprocess.TimeoutExpired):
        text = ""
    if "open mpi" in text or "open-mpi" in text or "openrte" in text:
        return "openmpi"
    if "intel" in text:
        return "intel"
    return "mpich"


def mpirun_command(mpirun: str, flavour: str, worker: list[str], num_processes: int, per_node: int,
                   hostfile: str | None, env_keys: Iterable[str]) -> list[str]:
    """The full command: ``mpirun <flags> python script args``.

    Example:
        >>> mpirun_command("mpirun", "openmpi", ["python", "t.py"], 2, 2, None, ["MASTER_PORT"])
        ['mpirun', '-n', '2', '--bind-to', 'none', '-x', 'MASTER_PORT', 'python', 't.py']
    """
    cmd = [mpirun, "-n", str(num_processes)]
    keys = sorted(env_keys)
    if flavour == "openmpi":
        cmd += ["--bind-to", "none"]  # pinning every rank to one core would serialize the CPU workers
        if hostfile:
            cmd += ["--hostfile", hostfile, "--npernode", str(per_node)]
        for key in keys:
            cmd += ["-x", key]
    else:
        if hostfile:
            cmd += ["-f", hostfile, "-ppn", str(per_node)]
        if keys:
            cmd += ["-genvlist", ",".join(keys)]
    return cmd + worker
