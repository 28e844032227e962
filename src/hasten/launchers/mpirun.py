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
        return None  # torchrun's workers: hasten.launchers.machines.store handles those
    from hasten.environments import detect_process_info
    from hasten.launchers.machines.store import bind_worker_store

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


#: Open MPI's settings for a run on this machine alone (no hostfile): its out-of-band channel (mpirun's
#: contact address, handed to every process) on loopback, and no TCP transport between MPI processes (one
#: machine talks through shared memory; the TCP transport would listen on every interface).
OPENMPI_LOOPBACK_MCA = {"oob_tcp_if_include": "lo", "btl": "^tcp"}


def openmpi_loopback_flags(env: Mapping[str, str]) -> list[str]:
    """``--mca NAME VALUE`` for each of :data:`OPENMPI_LOOPBACK_MCA` the user did not set (``OMPI_MCA_NAME``).

    Open MPI's ``mpirun`` itself still opens its out-of-band listeners on every interface (Open MPI 4 and 5 bind
    them to the wildcard address whatever the settings); with these flags nothing is told to connect there.

    Example:
        >>> openmpi_loopback_flags({})
        ['--mca', 'oob_tcp_if_include', 'lo', '--mca', 'btl', '^tcp']
    """
    flags: list[str] = []
    for name, value in OPENMPI_LOOPBACK_MCA.items():
        if f"OMPI_MCA_{name}" not in env:
            flags += ["--mca", name, value]
    return flags


def mpirun_command(mpirun: str, flavour: str, worker: list[str], num_processes: int, per_node: int,
                   hostfile: str | None, env_keys: Iterable[str], env: Mapping[str, str] | None = None) -> list[str]:
    """The full command: ``mpirun <flags> python script args``. Without a hostfile the run stays on this
    machine, and Open MPI is kept on loopback (:func:`openmpi_loopback_flags`, given the launcher's ``env``).

    Example:
        >>> mpirun_command("mpirun", "openmpi", ["python", "t.py"], 2, 2, "hosts", ["MASTER_PORT"])[:5]
        ['mpirun', '-n', '2', '--bind-to', 'none']
    """
    cmd = [mpirun, "-n", str(num_processes)]
    keys = sorted(env_keys)
    if flavour == "openmpi":
        cmd += ["--bind-to", "none"]  # pinning every rank to one core would serialize the CPU workers
        if hostfile:
            cmd += ["--hostfile", hostfile, "--npernode", str(per_node)]
        else:
            cmd += openmpi_loopback_flags(env or {})
        for key in keys:
            cmd += ["-x", key]
    else:
        if hostfile:
            cmd += ["-f", hostfile, "-ppn", str(per_node)]
        if keys:
            cmd += ["-genvlist", ",".join(keys)]
    return cmd + worker
