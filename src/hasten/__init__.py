"""hasten: one ordinary PyTorch training loop on a CPU, GPUs or many machines, with Accelerate's API.

Public names are imported lazily so that ``import hasten`` (and ``hasten launch``) start fast.
"""

from __future__ import annotations

from hasten._lazy import lazy_getattr

__version__ = "0.1.0"

_EXPORTS = {
    "Accelerator": "hasten.accelerator",
    "GradientAccumulationPlugin": "hasten.utils.dataclasses",
    "ProjectConfiguration": "hasten.utils.dataclasses",
    "skip_first_batches": "hasten.data",
    "PartialState": "hasten.state",
    "AcceleratorState": "hasten.state",
    "GradientState": "hasten.state",
    "DistributedType": "hasten.utils.dataclasses",
    "InitProcessGroupKwargs": "hasten.utils.dataclasses",
    "DistributedDataParallelKwargs": "hasten.utils.dataclasses",
    "GradScalerKwargs": "hasten.utils.dataclasses",
    "AutocastKwargs": "hasten.utils.dataclasses",
    "DataLoaderConfiguration": "hasten.utils.dataclasses",
    "DDPCommunicationHookType": "hasten.utils.dataclasses",
    "synchronize_rng_states": "hasten.ops.random",
    "ProfileKwargs": "hasten.utils.dataclasses",
    "find_executable_batch_size": "hasten.utils.memory",
    "FullyShardedDataParallelPlugin": "hasten.config.plugins.fsdp",
    "DeepSpeedPlugin": "hasten.config.plugins.deepspeed",
    "prepare_data_loader": "hasten.data",
    "notebook_launcher": "hasten.launchers.notebook",
    "debug_launcher": "hasten.launchers.notebook",
    "cpu_offload": "hasten.big_modeling",
    "cpu_offload_with_hook": "hasten.big_modeling",
    "disk_offload": "hasten.big_modeling",
    "dispatch_model": "hasten.big_modeling",
    "init_empty_weights": "hasten.big_modeling",
    "init_on_device": "hasten.big_modeling",
    "load_checkpoint_and_dispatch": "hasten.big_modeling",
    "infer_auto_device_map": "hasten.big_modeling",
    "load_checkpoint_in_model": "hasten.big_modeling",
    "TorchDynamoPlugin": "hasten.utils.dataclasses",
    "ParallelismConfig": "hasten.parallelism_config",
    "is_rich_available": "hasten.utils.imports",
    "prepare_pippy": "hasten.inference",
}


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))


__all__ = sorted(_EXPORTS)  # noqa: PLE0605
