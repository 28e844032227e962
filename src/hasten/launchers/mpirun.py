"""Wrapping the workers in ``mpirun`` (OpenMPI, Intel MPI or MPICH).

MPI starts the processes and tells each its rank; the workers meet at ``MASTER_ADDR:MASTER_PORT``
(``PartialState`` reads the MPI variables through ``hasten.environments``).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterable

from hasten.exceptions import LaunchError


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
