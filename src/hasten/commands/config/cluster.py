"""Accelerate's ``accelerate.commands.config.cluster``: the questions for a local machine or a cluster."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hasten._lazy import accelerate_path_getattr

if TYPE_CHECKING:
    from hasten.commands.config.config_args import ClusterConfig
    from hasten.commands.questionnaire import Prompter


def get_cluster_input(prompter: Prompter | None = None) -> ClusterConfig:
    """Ask ``hasten config``'s questions (on stdin) and return the answers as a validated ``ClusterConfig``.

    Raises:
        ConfigurationError: the answers do not make a configuration ``hasten launch`` accepts.

    Example:
        >>> get_cluster_input().to_dict()  # doctest: +SKIP
        {'compute_environment': 'LOCAL_MACHINE', 'distributed_type': 'MULTI_GPU', ...}
    """
    from hasten.commands.config.config_args import ClusterConfig
    from hasten.commands.questionnaire import run_questionnaire
    from hasten.config.schema import LaunchConfig

    config = LaunchConfig.from_dict(run_questionnaire(prompter), source="your answers")
    return ClusterConfig(**config.to_dict())

# Names Accelerate's module at this path shows but defines elsewhere (hasten/_accelerate_shown.py).
__getattr__ = accelerate_path_getattr(__name__, globals())
