"""Accelerate-compatible ``hasten.utils``: helpers from every part of hasten under one name.

This package is also hasten's bottom layer (``utils.environment``, ``utils.dataclasses``...). The
re-exports of higher layers are resolved lazily on first access, so importing a bottom-layer module
never drags in (or cycles through) the rest of the library.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {}


def _add(module: str, *names: str) -> None:
    for name in names:
        _EXPORTS[name] = module


_add("hasten.utils.dataclasses", "AutocastKwargs", "ComputeEnvironment", "DataLoaderConfiguration",
     "DDPCommunicationHookType", "DistributedDataParallelKwargs", "DistributedType", "DynamoBackend",
     "GradientAccumulationPlugin", "GradScalerKwargs", "InitProcessGroupKwargs", "KwargsHandler", "LoggerType",
     "PrecisionType", "ProfileKwargs", "ProjectConfiguration", "RNGType", "TorchDynamoPlugin")
_add("hasten.utils.sizes", "convert_file_size_to_int")
_add("hasten.config.plugins.fsdp", "FullyShardedDataParallelPlugin")
_add("hasten.config.parallelism", "ParallelismConfig", "TorchContextParallelConfig", "TorchTensorParallelConfig")
_add("hasten.checkpointing.dcp", "merge_fsdp_weights")
_add("hasten.config.plugins.deepspeed", "DeepSpeedPlugin")
_add("hasten.utils.deepspeed", "DummyOptim", "DummyScheduler", "HfDeepSpeedConfig")
_add("hasten.utils.environment", "get_int_from_env", "parse_flag_from_env", "patch_environment", "str_to_bool")
_add("hasten.ops.tree", "concatenate", "convert_to_fp32", "find_batch_size", "find_device", "get_data_structure",
     "honor_type", "ignorant_find_batch_size", "is_namedtuple", "is_torch_tensor", "listify", "recursively_apply",
     "send_to_device", "slice_tensors")
_add("hasten.ops.collectives", "broadcast", "broadcast_object_list", "gather", "gather_object",
     "pad_across_processes", "pad_input_tensors", "reduce")
_add("hasten.ops.random", "set_seed", "synchronize_rng_state", "synchronize_rng_states")
_add("hasten.state", "wait_for_everyone")
_add("hasten.logging", "get_logger")
_add("hasten.utils.serialization", "save_atomically")
_add("hasten.config.io", "write_basic_config")
_add("hasten.utils.memory", "find_executable_batch_size", "release_memory", "clear_device_cache",
     "should_reduce_batch_size")
_add("hasten.tracking", "filter_trackers", "get_available_trackers")
_add("hasten.big_modeling",
     "infer_auto_device_map",
     "load_checkpoint_in_model",
     "calculate_maximum_sizes",
     "check_device_map",
     "compute_module_sizes",
     "compute_module_total_buffer_size",
     "dtype_byte_size",
     "find_tied_parameters",
     "get_balanced_memory",
     "get_max_layer_size",
     "get_max_memory",
     "has_offloaded_params",
     "id_tensor_storage",
     "load_offloaded_weights",
     "load_state_dict",
     "named_module_tensors",
     "retie_parameters",
     "set_module_tensor_to_device",
     "OffloadedWeightsLoader",
     "PrefixedDataset",
     "extract_submodules_state_dict",
     "load_offloaded_weight",
     "offload_state_dict",
     "offload_weight",
     "save_offload_index",
     "ModelHook",
     "AlignDevicesHook",
     "SequentialHook",
     "CpuOffload",
     "UserCpuOffloadHook",
     "add_hook_to_module",
     "remove_hook_from_module",
     "remove_hook_from_submodules",
     "attach_align_device_hook",
     "attach_align_device_hook_on_blocks",
     "attach_execution_device_hook",
)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hasten.utils' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))


# Eager on purpose: once `hasten.utils.tqdm` (the module) is imported, a lazy attribute would resolve to
# the module instead of the function.
from hasten.utils.tqdm import tqdm as tqdm  # noqa: E402
