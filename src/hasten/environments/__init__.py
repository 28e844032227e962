"""Cluster environments: who am I, who are my peers (pure functions of an env mapping)."""

from hasten.environments.base import ClusterEnvironment, MachineLayout, ProcessInfo, export_torch_env
from hasten.environments.clusters import (
    KubeflowTrainerEnvironment,
    SkyPilotEnvironment,
    detect_machine_layout,
)
from hasten.environments.detect import (
    DETECTION_ORDER,
    current_process_info,
    detect_environment,
    detect_process_info,
)
from hasten.environments.kubeflow import KubeflowEnvironment
from hasten.environments.local import LocalEnvironment, find_free_port
from hasten.environments.mpi import MPICHEnvironment, MVAPICHEnvironment, OpenMPIEnvironment
from hasten.environments.slurm import SLURMEnvironment, expand_hostlist
from hasten.environments.torchelastic import TorchElasticEnvironment

__all__ = [
    "DETECTION_ORDER", "ClusterEnvironment", "KubeflowEnvironment", "KubeflowTrainerEnvironment", "LocalEnvironment",
    "MPICHEnvironment", "MVAPICHEnvironment", "MachineLayout", "OpenMPIEnvironment", "ProcessInfo", "SLURMEnvironment",
    "SkyPilotEnvironment", "TorchElasticEnvironment", "detect_machine_layout",
    "current_process_info", "export_torch_env", "detect_environment", "detect_process_info", "expand_hostlist", "find_free_port",
]
