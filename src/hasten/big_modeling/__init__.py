"""Big model inference: build on ``meta``, compute device maps, load checkpoints shard by shard, offload."""

# ruff: noqa: F401, I001

from hasten._lazy import accelerate_path_getattr
from hasten.big_modeling.attach import (attach_align_device_hook, attach_align_device_hook_on_blocks,
                                        attach_execution_device_hook)
from hasten.big_modeling.device_map import check_device_map, clean_device_map, infer_auto_device_map
from hasten.big_modeling.dispatch import (cpu_offload, cpu_offload_with_hook, disk_offload, dispatch_model,
                                          load_checkpoint_and_dispatch)
from hasten.big_modeling.hooks import (AlignDevicesHook, CpuOffload, ModelHook, SequentialHook, UserCpuOffloadHook,
                                       WeightPrefetcher, add_hook_to_module, remove_hook_from_module,
                                       remove_hook_from_submodules)
from hasten.big_modeling.extras import (LayerwiseCastingHook, SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING,
                                        align_module_device, attach_layerwise_casting_hooks,
                                        check_tied_parameters_on_same_device, ensure_weights_retied,
                                        get_state_dict_offloaded_model)
from hasten.big_modeling.init import init_empty_weights, init_on_device
from hasten.big_modeling.loading import load_checkpoint_in_model, load_state_dict
from hasten.big_modeling.offload import (OffloadedWeightsLoader, PrefixedDataset, extract_submodules_state_dict,
                                         load_offloaded_weight, load_offloaded_weights, offload_state_dict,
                                         offload_weight, save_offload_index)
from hasten.big_modeling.sizes import (calculate_maximum_sizes, compute_module_sizes,
                                       compute_module_total_buffer_size, convert_file_size_to_int,
                                       get_balanced_memory, get_max_layer_size, get_max_memory)
from hasten.big_modeling.tensors import (dtype_byte_size, find_tied_parameters, has_offloaded_params,
                                         id_tensor_storage, named_module_tensors, retie_parameters,
                                         set_module_tensor_to_device)

__all__ = [name for name in dir() if not name.startswith("_") and name not in {
    "attach", "device_map", "dispatch", "extras", "hooks", "init", "loading", "offload", "sizes", "tensors"}]

# Names Accelerate's module at this path shows but defines elsewhere (hasten/_accelerate_shown.py).
__getattr__ = accelerate_path_getattr(__name__, globals())
