"""Accelerate-compatible ``hasten.utils``: helpers from every part of hasten under one name.

This package is also hasten's bottom layer (``utils.environment``, ``utils.dataclasses``...). The
re-exports of higher layers are resolved lazily on first access, so importing a bottom-layer module
never drags in (or cycles through) the rest of the library.
"""

from __future__ import annotations

from hasten._lazy import lazy_getattr

_EXPORTS: dict[str, str] = {}


def _add(module: str, *names: str) -> None:
    for name in names:
        _EXPORTS[name] = module


_add("hasten.utils.dataclasses", "AutocastKwargs", "ComputeEnvironment", "DataLoaderConfiguration",
     "DDPCommunicationHookType", "DistributedDataParallelKwargs", "DistributedType", "DynamoBackend",
     "GradientAccumulationPlugin", "GradScalerKwargs", "InitProcessGroupKwargs", "KwargsHandler", "LoggerType",
     "PrecisionType", "ProfileKwargs", "ProjectConfiguration", "RNGType", "TorchDynamoPlugin")
_add("hasten.utils.imports", *"""
    compare_versions is_4bit_bnb_available is_8bit_bnb_available is_aim_available is_amdsmi_available
    is_bf16_available is_bitsandbytes_multi_backend_available is_bnb_available is_boto3_available
    is_clearml_available is_comet_ml_available is_compiled_module is_cuda_available is_datasets_available
    is_deepspeed_available is_dvclive_available is_fp16_available is_fp8_available is_habana_gaudi1
    is_hpu_available is_import_timer_available is_lomo_available is_matplotlib_available is_megatron_lm_available
    is_mlflow_available is_mlu_available is_mps_available is_msamp_available is_musa_available is_neuron_available
    is_npu_available is_pandas_available is_peft_available is_peft_model is_pippy_available is_port_in_use
    is_pynvml_available is_pytest_available is_rich_available is_rocm_available is_sagemaker_available
    is_schedulefree_available is_sdaa_available is_swanlab_available is_tensorboard_available is_timm_available
    is_torch_version is_torch_xla_available is_torchao_available is_torchdata_available
    is_torchdata_stateful_dataloader_available is_torchvision_available is_trackio_available
    is_transformer_engine_available is_transformer_engine_mxfp8_available is_transformers_available
    is_triton_available is_wandb_available is_weights_only_available is_xccl_available is_xpu_available""".split())
_add("hasten.utils.constants", *"""
    MITA_PROFILING_AVAILABLE_PYTORCH_VERSION MODEL_NAME OPTIMIZER_NAME PROFILE_PATTERN_NAME RNG_STATE_NAME
    SAFE_MODEL_NAME SAFE_WEIGHTS_INDEX_NAME SAFE_WEIGHTS_NAME SAFE_WEIGHTS_PATTERN_NAME SAMPLER_NAME SCALER_NAME
    SCHEDULER_NAME TORCH_DISTRIBUTED_OPERATION_TYPES TORCH_LAUNCH_PARAMS WEIGHTS_INDEX_NAME WEIGHTS_NAME
    WEIGHTS_PATTERN_NAME XPU_PROFILING_AVAILABLE_PYTORCH_VERSION CustomDtype SageMakerDistributedType""".split())
_add("hasten.utils.unsupported", *"""
    AbstractTrainStep BertTrainStep BnbQuantizationConfig DeepSpeedSequenceParallelConfig GPTTrainStep
    MegatronLMDummyDataLoader MegatronLMDummyScheduler MegatronLMPlugin T5TrainStep
    TorchTensorParallelPlugin add_model_config_to_megatron_parser apply_fp8_autowrap
    avg_losses_across_data_parallel_group convert_model install_xla load_and_quantize_model load_fsdp_model
    load_fsdp_optimizer prepare_sagemager_args_inputs prepare_tpu save_fsdp_model save_fsdp_optimizer
    contextual_fp8_autocast save_accelerator_state load_accelerator_state prepare_deepspeed_cmd_env
    prepare_multi_gpu_env prepare_simple_launcher_cmd_env""".split())
_add("hasten.utils.modeling", *"""
    are_libraries_initialized check_os_kernel check_tied_parameters_in_config clean_state_dict_for_safetensors
    compile_regions compile_regions_deepspeed compile_regions_fsdp2 convert_bytes deepspeed_required
    extract_model_from_parallel get_fsdp2_grad_scaler get_grad_scaler get_mixed_precision_context_manager
    get_model_tp_size get_module_children_bottom_up get_pretty_name has_4bit_bnb_layers has_ao_layers
    has_compiled_regions has_transformer_engine_layers merge_dicts model_has_dtensor recursive_getattr
    torchao_required""".split())
_add("hasten.utils.fp8", "AORecipeKwargs", "FP8RecipeKwargs", "MSAMPRecipeKwargs", "TERecipeKwargs", "FP8BackendType",
     "convert_model_to_fp8_ao", "filter_first_and_last_linear_layers")
_add("hasten.checkpointing.custom", "save_custom_state", "load_custom_state")
_add("hasten.launchers.compat", "PrepareForLaunch")
_add("hasten.utils.fsdp2", "fsdp2_apply_ac", "fsdp2_canonicalize_names", "fsdp2_load_full_state_dict",
     "fsdp2_prepare_model", "fsdp2_switch_optimizer_parameters")
_add("hasten.utils.serialization", "save", "load")
_add("hasten.exceptions", "DistributedOperationException")
_add("hasten.ops.compat", "CannotPadNestedTensorWarning", "GatheredParameters", "TensorInformation",
     "convert_outputs_to_fp32", "copy_tensor_to_devices", "initialize_tensors", "is_tensor_information")
_add("hasten.parallelism_config", "ParallelismConfig", "TorchContextParallelConfig", "TorchTensorParallelConfig")
_add("hasten.big_modeling", "align_module_device", "check_tied_parameters_on_same_device", "ensure_weights_retied",
     "get_state_dict_offloaded_model")
_add("hasten.utils.sizes", "convert_file_size_to_int")
_add("hasten.config.plugins.fsdp", "FullyShardedDataParallelPlugin")
_add("hasten.checkpointing.dcp", "merge_fsdp_weights")
_add("hasten.config.plugins.deepspeed", "DeepSpeedPlugin")
_add("hasten.utils.deepspeed", "DummyOptim", "DummyScheduler", "HfDeepSpeedConfig")
_add("hasten.utils.environment", "get_int_from_env", "parse_flag_from_env", "patch_environment", "str_to_bool",
     "check_cuda_fp8_capability", "check_cuda_p2p_ib_support", "clear_environment", "convert_dict_to_env_variables",
     "disable_fsdp_ram_efficient_loading", "enable_fsdp_ram_efficient_loading", "get_cpu_distributed_information",
     "get_current_device_type", "get_gpu_info", "parse_choice_from_env", "purge_accelerate_environment",
     "set_numa_affinity")
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


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))


# Eager on purpose: once `hasten.utils.tqdm` (the module) is imported, a lazy attribute would resolve to
# the module instead of the function.
from hasten.utils.tqdm import tqdm as tqdm  # noqa: E402
