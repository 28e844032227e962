"""Pick the cluster environment that started this process."""

from __future__ import annotations

import os
from collections.abc import Mapping

from hasten.environments.base import ClusterEnvironment, ProcessInfo
from hasten.environments.clusters import KubeflowTrainerEnvironment, SkyPilotEnvironment
from hasten.environments.kubeflow import KubeflowEnvironment
from hasten.environments.local import LocalEnvironment
from hasten.environments.mpi import MPICHEnvironment, MVAPICHEnvironment, OpenMPIEnvironment
from hasten.environments.slurm import SLURMEnvironment
from hasten.environments.torchelastic import TorchElasticEnvironment

# Order matters: torchrun inside a SLURM allocation, under mpirun or in a Kubeflow/SkyPilot machine sets its
# own variables, and those describe the processes that actually exist. Kubeflow Trainer v2 and SkyPilot describe
# machines; they are this process's place only when it was started alone on its machine.
DETECTION_ORDER: tuple[type[ClusterEnvironment], ...] = (
    TorchElasticEnvironment,
    OpenMPIEnvironment,
    MPICHEnvironment,
    MVAPICHEnvironment,
    SLURMEnvironment,
    KubeflowEnvironment,
    KubeflowTrainerEnvironment,
    SkyPilotEnvironment,
    LocalEnvironment,
)


def detect_environment(env: Mapping[str, str]) -> ClusterEnvironment:
    """The first environment whose variables are present in ``env``.

    Example:
        >>> detect_environment({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}).name
        'torchelastic'
    """
    for cls in DETECTION_ORDER:
        if cls.detect(env):
            return cls()
    raise AssertionError("LocalEnvironment always matches")


def detect_process_info(env: Mapping[str, str]) -> tuple[ClusterEnvironment, ProcessInfo]:
    """Detect the environment and read this process's place from ``env``."""
    environment = detect_environment(env)
    return environment, environment.process_info(env)


def current_process_info() -> tuple[ClusterEnvironment, ProcessInfo]:
    """Detect from this process's real environment."""
    return detect_process_info(os.environ)
