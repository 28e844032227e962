"""A real SLURM cluster for tests: ``slurmctld`` + one ``slurmd`` per simulated machine, with ``munge``.

The daemons come from the OS packages (Debian/Ubuntu: ``slurmctld slurmd slurm-client munge``). Each
machine is a network namespace (:mod:`hasten.testing.netns`) and a UTS namespace whose host name is the
SLURM node name; every file (configuration, munge key and socket, spool, state, logs) lives in a
folder the caller owns, so nothing on the host is configured and the host's own daemons are untouched.
Clients run with ``SLURM_CONF`` pointing at that configuration (see :meth:`SlurmCluster.env`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from hasten.testing.netns import Machine

DAEMONS = ("slurmctld", "slurmd", "munged", "mungekey", "sbatch", "srun", "sinfo", "unshare")


def slurm_unavailable() -> str | None:
    """Why a SLURM cluster cannot be started here (None when it can)."""
    missing = [name for name in DAEMONS if shutil.which(name) is None]
    if missing:
        return (f"{', '.join(missing)} not installed (apt-get install slurmctld slurmd slurm-client munge; "
                ".ci/run does it on CI machines)")
    return None


@dataclass
class SlurmCluster:
    """A running cluster: its folder, its machines (node0, node1, ...) and the client environment."""

    folder: Path
    machines: list[Machine]

    def env(self, base: Mapping[str, str]) -> dict[str, str]:
        """``base`` plus what SLURM clients need to reach this cluster."""
        return {**base, "SLURM_CONF": str(self.folder / "slurm.conf")}

    def on_node(self, index: int, argv: list[str]) -> list[str]:
        """``argv`` run on node ``index`` (its network namespace and host name), e.g. ``sbatch``."""
        return _in_machine(self.machines[index], index, argv)


def _in_machine(machine: Machine, index: int, argv: list[str]) -> list[str]:
    # A UTS namespace gives the process the node's host name, which slurmctld/slurmd check against the config.
    script = f'hostname node{index} && exec "$@"'
    return machine.command(["unshare", "--uts", "sh", "-c", script, "sh", *argv])


def _config(folder: Path, machines: list[Machine], cpus: int) -> str:
    nodes = "\n".join(f"NodeName=node{i} NodeAddr={m.ip} CPUs={cpus} State=UNKNOWN" for i, m in enumerate(machines))
    return f"""ClusterName=hasten
SlurmctldHost=node0({machines[0].ip})
AuthType=auth/munge
CredType=cred/munge
# A requeued job may start again cred_expire + 1 s after it ended (the nodes must have forgotten its old
# credential); 120 s by default, 5 is SLURM's minimum.
AuthInfo=socket={folder}/munge.socket,cred_expire=5
SlurmUser=root
SlurmdUser=root
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool-%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
LaunchParameters=use_interactive_step
ReturnToService=2
SchedulerType=sched/builtin
# Only the main scheduling loop (every 60 s by default) starts a pending job whose BeginTime passed, e.g. a
# requeued one; a pass every second costs nothing on two nodes and also starts a batch job ~1 s after sbatch
# (~3 s with the default).
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=3
MessageTimeout=20
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""


def _wait_for_nodes(cluster: SlurmCluster, env: Mapping[str, str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    states = ""
    while time.monotonic() < deadline:
        done = subprocess.run(cluster.on_node(0, ["sinfo", "-h", "-N", "-o", "%N %t"]), env=env, capture_output=True,
                              text=True, timeout=30)
        states = done.stdout.strip()
        lines = states.splitlines()
        if len(lines) == len(cluster.machines) and all(line.split()[1] == "idle" for line in lines):
            return
        time.sleep(0.5)
    logs = "\n".join(p.read_text()[-2000:] for p in sorted(cluster.folder.glob("*.log")))
    raise RuntimeError(f"SLURM nodes not idle within {timeout:.0f} s (sinfo: {states!r})\n{logs}")


@contextlib.contextmanager
def slurm_cluster(machines: list[Machine], folder: Path, cpus: int = 2, timeout: float = 60) -> Iterator[SlurmCluster]:
    """Start munged, slurmctld on machine 0 and a slurmd on every machine; stop them all afterwards."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)  # munged refuses key and socket folders others can write to
    (folder / "state").mkdir(exist_ok=True)
    (folder / "slurm.conf").write_text(_config(folder, machines, cpus))
    # slurmd initialises a cgroup plugin even when nothing uses it; autodetection fails on hybrid hierarchies.
    (folder / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\nCgroupAutomount=no\n")
    for index in range(len(machines)):
        (folder / f"spool-node{index}").mkdir(exist_ok=True)
    key = folder / "munge.key"
    subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True, timeout=30)
    key.chmod(0o600)
    cluster = SlurmCluster(folder, machines)
    env = cluster.env(os.environ)
    daemons: list[subprocess.Popen[bytes]] = []

    def start(name: str, argv: list[str]) -> None:
        with open(folder / f"{name}.out", "ab") as log:
            daemons.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True))

    try:
        start("munged", ["munged", "--foreground", "--force", f"--socket={folder}/munge.socket", f"--key-file={key}",
               f"--pid-file={folder}/munged.pid", f"--log-file={folder}/munged.log",
               f"--seed-file={folder}/munge.seed"])
        deadline = time.monotonic() + 30
        while not (folder / "munge.socket").exists():
            if time.monotonic() > deadline or daemons[0].poll() is not None:
                raise RuntimeError(f"munged did not start; see {folder}/munged.out and munged.log")
            time.sleep(0.05)
        start("slurmctld", cluster.on_node(0, ["slurmctld", "-D", "-c", "-i"]))
        for index in range(len(machines)):
            start(f"slurmd{index}", cluster.on_node(index, ["slurmd", "-D", "-N", f"node{index}"]))
        _wait_for_nodes(cluster, env, timeout)
        yield cluster
    finally:
        for proc in reversed(daemons):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in daemons:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
