"""hasten: one ordinary PyTorch training loop on a CPU, GPUs or many machines, with Accelerate's API.

Public names are imported lazily so that ``import hasten`` (and ``hasten launch``) start fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hasten._lazy import lazy_getattr

__version__ = "0.1.0"

_EXPORTS = {
    "Accelerator": "hasten.accelerator.core",
    "GradientAccumulationPlugin": "hasten.base.dataclasses",
    "ProjectConfiguration": "hasten.base.dataclasses",
    "skip_first_batches": "hasten.data",
    "PartialState": "hasten.state",
    "AcceleratorState": "hasten.state",
    "GradientState": "hasten.state",
    "DistributedType": "hasten.base.dataclasses",
    "InitProcessGroupKwargs": "hasten.base.dataclasses",
    "DistributedDataParallelKwargs": "hasten.base.dataclasses",
    "GradScalerKwargs": "hasten.base.dataclasses",
    "AutocastKwargs": "hasten.base.dataclasses",
    "DataLoaderConfiguration": "hasten.base.dataclasses",
    "DDPCommunicationHookType": "hasten.base.dataclasses",
    "synchronize_rng_states": "hasten.ops.random",
    "ProfileKwargs": "hasten.base.dataclasses",
    "find_executable_batch_size": "hasten.base.memory",
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
    "TorchDynamoPlugin": "hasten.base.dataclasses",
    "ParallelismConfig": "hasten.parallelism_config",
    "is_rich_available": "hasten.base.imports",
    "prepare_pippy": "hasten.inference",
    "plan_memory": "hasten.memory_plan",
    "MemoryPlan": "hasten.memory_plan",
    "install_as_accelerate": "hasten._accelerate_alias",
    "uninstall_as_accelerate": "hasten._accelerate_alias",
    "PREEMPTED_EXIT_CODE": "hasten.runtime.preemption",
}

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time the names resolve on first use
    from hasten._accelerate_alias import (
        install_as_accelerate as install_as_accelerate,
        uninstall_as_accelerate as uninstall_as_accelerate,
    )
    from hasten.accelerator.core import Accelerator as Accelerator
    from hasten.base.dataclasses import (
        AutocastKwargs as AutocastKwargs,
        DataLoaderConfiguration as DataLoaderConfiguration,
        DDPCommunicationHookType as DDPCommunicationHookType,
        DistributedDataParallelKwargs as DistributedDataParallelKwargs,
        DistributedType as DistributedType,
        GradientAccumulationPlugin as GradientAccumulationPlugin,
        GradScalerKwargs as GradScalerKwargs,
        InitProcessGroupKwargs as InitProcessGroupKwargs,
        ProfileKwargs as ProfileKwargs,
        ProjectConfiguration as ProjectConfiguration,
        TorchDynamoPlugin as TorchDynamoPlugin,
    )
    from hasten.base.imports import is_rich_available as is_rich_available
    from hasten.base.memory import find_executable_batch_size as find_executable_batch_size
    from hasten.big_modeling import (
        cpu_offload as cpu_offload,
        cpu_offload_with_hook as cpu_offload_with_hook,
        disk_offload as disk_offload,
        dispatch_model as dispatch_model,
        infer_auto_device_map as infer_auto_device_map,
        init_empty_weights as init_empty_weights,
        init_on_device as init_on_device,
        load_checkpoint_and_dispatch as load_checkpoint_and_dispatch,
        load_checkpoint_in_model as load_checkpoint_in_model,
    )
    from hasten.config.plugins.deepspeed import DeepSpeedPlugin as DeepSpeedPlugin
    from hasten.config.plugins.fsdp import FullyShardedDataParallelPlugin as FullyShardedDataParallelPlugin
    from hasten.data import (
        prepare_data_loader as prepare_data_loader,
        skip_first_batches as skip_first_batches,
    )
    from hasten.inference import prepare_pippy as prepare_pippy
    from hasten.launchers.notebook import (
        debug_launcher as debug_launcher,
        notebook_launcher as notebook_launcher,
    )
    from hasten.memory_plan import MemoryPlan as MemoryPlan, plan_memory as plan_memory
    from hasten.ops.random import synchronize_rng_states as synchronize_rng_states
    from hasten.parallelism_config import ParallelismConfig as ParallelismConfig
    from hasten.runtime.preemption import PREEMPTED_EXIT_CODE as PREEMPTED_EXIT_CODE
    from hasten.state import (
        AcceleratorState as AcceleratorState,
        GradientState as GradientState,
        PartialState as PartialState,
    )

__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))


__all__ = sorted(_EXPORTS)  # noqa: PLE0605
