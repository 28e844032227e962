"""Accelerate-compatible ``hasten.utils``: helpers from every part of hasten under one name.

This package is also hasten's bottom layer (``utils.environment``, ``utils.dataclasses``...). The
re-exports of higher layers are resolved lazily on first access, so importing a bottom-layer module
never drags in (or cycles through) the rest of the library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hasten._lazy import lazy_getattr

_EXPORTS: dict[str, str] = {}


def _add(module: str, *names: str) -> None:
    for name in names:
        _EXPORTS[name] = module


_add("hasten.base.dataclasses", "AutocastKwargs", "ComputeEnvironment", "DataLoaderConfiguration",
     "DDPCommunicationHookType", "DistributedDataParallelKwargs", "DistributedType", "DynamoBackend",
     "GradientAccumulationPlugin", "GradScalerKwargs", "InitProcessGroupKwargs", "KwargsHandler", "LoggerType",
     "PrecisionType", "ProfileKwargs", "ProjectConfiguration", "RNGType", "TorchDynamoPlugin",
     "TorchTensorParallelPlugin")
_add("hasten.base.imports", *"""
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
_add("hasten.base.constants", *"""
    MITA_PROFILING_AVAILABLE_PYTORCH_VERSION MODEL_NAME OPTIMIZER_NAME PROFILE_PATTERN_NAME RNG_STATE_NAME
    SAFE_MODEL_NAME SAFE_WEIGHTS_INDEX_NAME SAFE_WEIGHTS_NAME SAFE_WEIGHTS_PATTERN_NAME SAMPLER_NAME SCALER_NAME
    SCHEDULER_NAME TORCH_DISTRIBUTED_OPERATION_TYPES TORCH_LAUNCH_PARAMS WEIGHTS_INDEX_NAME WEIGHTS_NAME
    WEIGHTS_PATTERN_NAME XPU_PROFILING_AVAILABLE_PYTORCH_VERSION CustomDtype SageMakerDistributedType""".split())
_add("hasten.base.unsupported", *"""
    AbstractTrainStep BertTrainStep BnbQuantizationConfig DeepSpeedSequenceParallelConfig GPTTrainStep
    MegatronLMDummyDataLoader MegatronLMDummyScheduler MegatronLMPlugin T5TrainStep
    add_model_config_to_megatron_parser apply_fp8_autowrap
    avg_losses_across_data_parallel_group convert_model install_xla load_and_quantize_model
    prepare_sagemager_args_inputs prepare_tpu
    contextual_fp8_autocast prepare_deepspeed_cmd_env""".split())
_add("hasten.commands.launch_env", "prepare_multi_gpu_env", "prepare_simple_launcher_cmd_env")
_add("hasten.base.modeling", *"""
    are_libraries_initialized check_os_kernel check_tied_parameters_in_config clean_state_dict_for_safetensors
    compile_regions compile_regions_deepspeed compile_regions_fsdp2 convert_bytes
    extract_model_from_parallel get_fsdp2_grad_scaler get_grad_scaler
    get_model_tp_size get_module_children_bottom_up get_pretty_name has_4bit_bnb_layers has_ao_layers
    has_compiled_regions has_transformer_engine_layers merge_dicts model_has_dtensor recursive_getattr
    torchao_required""".split())
_add("hasten.base.fp8", "AORecipeKwargs", "FP8RecipeKwargs", "MSAMPRecipeKwargs", "TERecipeKwargs", "FP8BackendType",
     "convert_model_to_fp8_ao", "filter_first_and_last_linear_layers")
_add("hasten.checkpointing.custom", "load_custom_state")
_add("hasten.state_helpers", "deepspeed_required", "get_mixed_precision_context_manager", "save", "save_custom_state")
_add("hasten.accelerator_state_files", "save_accelerator_state", "load_accelerator_state")
_add("hasten.launchers.compat", "PrepareForLaunch")
_add("hasten.base.fsdp2", "fsdp2_apply_ac", "fsdp2_canonicalize_names", "fsdp2_load_full_state_dict",
     "fsdp2_prepare_model", "fsdp2_switch_optimizer_parameters")
_add("hasten.base.serialization", "load")
_add("hasten.exceptions", "DistributedOperationException")
_add("hasten.ops.collectives", "CannotPadNestedTensorWarning")
_add("hasten.ops.compat", "GatheredParameters", "TensorInformation",
     "convert_outputs_to_fp32", "copy_tensor_to_devices", "initialize_tensors", "is_tensor_information")
_add("hasten.parallelism_config", "ParallelismConfig", "TorchContextParallelConfig", "TorchTensorParallelConfig")
_add("hasten.big_modeling", "align_module_device", "check_tied_parameters_on_same_device", "ensure_weights_retied",
     "get_state_dict_offloaded_model")
_add("hasten.base.sizes", "convert_file_size_to_int")
_add("hasten.config.plugins.fsdp", "FullyShardedDataParallelPlugin")
_add("hasten.checkpointing.dcp", "merge_fsdp_weights")
_add("hasten.checkpointing.fsdp_files", "load_fsdp_model", "load_fsdp_optimizer", "save_fsdp_model", "save_fsdp_optimizer")
_add("hasten.config.plugins.deepspeed", "DeepSpeedPlugin")
_add("hasten.base.deepspeed", "DummyOptim", "DummyScheduler", "HfDeepSpeedConfig")
_add("hasten.strategies.deepspeed", "DeepSpeedEngineWrapper")
_add("hasten.optim", "DeepSpeedOptimizerWrapper", "DeepSpeedSchedulerWrapper")
_add("hasten.config.plugins.deepspeed", "get_active_deepspeed_plugin", "map_pytorch_optim_to_deepspeed")
_add("hasten.base.environment", "get_int_from_env", "parse_flag_from_env", "patch_environment", "str_to_bool",
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
_add("hasten.base.serialization", "save_atomically")
_add("hasten.config.io", "write_basic_config")
_add("hasten.base.memory", "find_executable_batch_size", "release_memory", "clear_device_cache",
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

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time the names resolve on first use
    from hasten.accelerator_state_files import (
        load_accelerator_state as load_accelerator_state,
        save_accelerator_state as save_accelerator_state,
    )
    from hasten.base.constants import (
        MITA_PROFILING_AVAILABLE_PYTORCH_VERSION as MITA_PROFILING_AVAILABLE_PYTORCH_VERSION,
        MODEL_NAME as MODEL_NAME,
        OPTIMIZER_NAME as OPTIMIZER_NAME,
        PROFILE_PATTERN_NAME as PROFILE_PATTERN_NAME,
        RNG_STATE_NAME as RNG_STATE_NAME,
        SAFE_MODEL_NAME as SAFE_MODEL_NAME,
        SAFE_WEIGHTS_INDEX_NAME as SAFE_WEIGHTS_INDEX_NAME,
        SAFE_WEIGHTS_NAME as SAFE_WEIGHTS_NAME,
        SAFE_WEIGHTS_PATTERN_NAME as SAFE_WEIGHTS_PATTERN_NAME,
        SAMPLER_NAME as SAMPLER_NAME,
        SCALER_NAME as SCALER_NAME,
        SCHEDULER_NAME as SCHEDULER_NAME,
        TORCH_DISTRIBUTED_OPERATION_TYPES as TORCH_DISTRIBUTED_OPERATION_TYPES,
        TORCH_LAUNCH_PARAMS as TORCH_LAUNCH_PARAMS,
        WEIGHTS_INDEX_NAME as WEIGHTS_INDEX_NAME,
        WEIGHTS_NAME as WEIGHTS_NAME,
        WEIGHTS_PATTERN_NAME as WEIGHTS_PATTERN_NAME,
        XPU_PROFILING_AVAILABLE_PYTORCH_VERSION as XPU_PROFILING_AVAILABLE_PYTORCH_VERSION,
        CustomDtype as CustomDtype,
        SageMakerDistributedType as SageMakerDistributedType,
    )
    from hasten.base.dataclasses import (
        AutocastKwargs as AutocastKwargs,
        ComputeEnvironment as ComputeEnvironment,
        DataLoaderConfiguration as DataLoaderConfiguration,
        DDPCommunicationHookType as DDPCommunicationHookType,
        DistributedDataParallelKwargs as DistributedDataParallelKwargs,
        DistributedType as DistributedType,
        DynamoBackend as DynamoBackend,
        GradientAccumulationPlugin as GradientAccumulationPlugin,
        GradScalerKwargs as GradScalerKwargs,
        InitProcessGroupKwargs as InitProcessGroupKwargs,
        KwargsHandler as KwargsHandler,
        LoggerType as LoggerType,
        PrecisionType as PrecisionType,
        ProfileKwargs as ProfileKwargs,
        ProjectConfiguration as ProjectConfiguration,
        RNGType as RNGType,
        TorchDynamoPlugin as TorchDynamoPlugin,
        TorchTensorParallelPlugin as TorchTensorParallelPlugin,
    )
    from hasten.base.deepspeed import (
        DummyOptim as DummyOptim,
        DummyScheduler as DummyScheduler,
        HfDeepSpeedConfig as HfDeepSpeedConfig,
    )
    from hasten.base.environment import (
        check_cuda_fp8_capability as check_cuda_fp8_capability,
        check_cuda_p2p_ib_support as check_cuda_p2p_ib_support,
        clear_environment as clear_environment,
        convert_dict_to_env_variables as convert_dict_to_env_variables,
        disable_fsdp_ram_efficient_loading as disable_fsdp_ram_efficient_loading,
        enable_fsdp_ram_efficient_loading as enable_fsdp_ram_efficient_loading,
        get_cpu_distributed_information as get_cpu_distributed_information,
        get_current_device_type as get_current_device_type,
        get_gpu_info as get_gpu_info,
        get_int_from_env as get_int_from_env,
        parse_choice_from_env as parse_choice_from_env,
        parse_flag_from_env as parse_flag_from_env,
        patch_environment as patch_environment,
        purge_accelerate_environment as purge_accelerate_environment,
        set_numa_affinity as set_numa_affinity,
        str_to_bool as str_to_bool,
    )
    from hasten.base.fp8 import (
        AORecipeKwargs as AORecipeKwargs,
        FP8BackendType as FP8BackendType,
        FP8RecipeKwargs as FP8RecipeKwargs,
        MSAMPRecipeKwargs as MSAMPRecipeKwargs,
        TERecipeKwargs as TERecipeKwargs,
        convert_model_to_fp8_ao as convert_model_to_fp8_ao,
        filter_first_and_last_linear_layers as filter_first_and_last_linear_layers,
    )
    from hasten.base.fsdp2 import (
        fsdp2_apply_ac as fsdp2_apply_ac,
        fsdp2_canonicalize_names as fsdp2_canonicalize_names,
        fsdp2_load_full_state_dict as fsdp2_load_full_state_dict,
        fsdp2_prepare_model as fsdp2_prepare_model,
        fsdp2_switch_optimizer_parameters as fsdp2_switch_optimizer_parameters,
    )
    from hasten.base.imports import (
        compare_versions as compare_versions,
        is_4bit_bnb_available as is_4bit_bnb_available,
        is_8bit_bnb_available as is_8bit_bnb_available,
        is_aim_available as is_aim_available,
        is_amdsmi_available as is_amdsmi_available,
        is_bf16_available as is_bf16_available,
        is_bitsandbytes_multi_backend_available as is_bitsandbytes_multi_backend_available,
        is_bnb_available as is_bnb_available,
        is_boto3_available as is_boto3_available,
        is_clearml_available as is_clearml_available,
        is_comet_ml_available as is_comet_ml_available,
        is_compiled_module as is_compiled_module,
        is_cuda_available as is_cuda_available,
        is_datasets_available as is_datasets_available,
        is_deepspeed_available as is_deepspeed_available,
        is_dvclive_available as is_dvclive_available,
        is_fp8_available as is_fp8_available,
        is_fp16_available as is_fp16_available,
        is_habana_gaudi1 as is_habana_gaudi1,
        is_hpu_available as is_hpu_available,
        is_import_timer_available as is_import_timer_available,
        is_lomo_available as is_lomo_available,
        is_matplotlib_available as is_matplotlib_available,
        is_megatron_lm_available as is_megatron_lm_available,
        is_mlflow_available as is_mlflow_available,
        is_mlu_available as is_mlu_available,
        is_mps_available as is_mps_available,
        is_msamp_available as is_msamp_available,
        is_musa_available as is_musa_available,
        is_neuron_available as is_neuron_available,
        is_npu_available as is_npu_available,
        is_pandas_available as is_pandas_available,
        is_peft_available as is_peft_available,
        is_peft_model as is_peft_model,
        is_pippy_available as is_pippy_available,
        is_port_in_use as is_port_in_use,
        is_pynvml_available as is_pynvml_available,
        is_pytest_available as is_pytest_available,
        is_rich_available as is_rich_available,
        is_rocm_available as is_rocm_available,
        is_sagemaker_available as is_sagemaker_available,
        is_schedulefree_available as is_schedulefree_available,
        is_sdaa_available as is_sdaa_available,
        is_swanlab_available as is_swanlab_available,
        is_tensorboard_available as is_tensorboard_available,
        is_timm_available as is_timm_available,
        is_torch_version as is_torch_version,
        is_torch_xla_available as is_torch_xla_available,
        is_torchao_available as is_torchao_available,
        is_torchdata_available as is_torchdata_available,
        is_torchdata_stateful_dataloader_available as is_torchdata_stateful_dataloader_available,
        is_torchvision_available as is_torchvision_available,
        is_trackio_available as is_trackio_available,
        is_transformer_engine_available as is_transformer_engine_available,
        is_transformer_engine_mxfp8_available as is_transformer_engine_mxfp8_available,
        is_transformers_available as is_transformers_available,
        is_triton_available as is_triton_available,
        is_wandb_available as is_wandb_available,
        is_weights_only_available as is_weights_only_available,
        is_xccl_available as is_xccl_available,
        is_xpu_available as is_xpu_available,
    )
    from hasten.base.memory import (
        clear_device_cache as clear_device_cache,
        find_executable_batch_size as find_executable_batch_size,
        release_memory as release_memory,
        should_reduce_batch_size as should_reduce_batch_size,
    )
    from hasten.base.modeling import (
        are_libraries_initialized as are_libraries_initialized,
        check_os_kernel as check_os_kernel,
        check_tied_parameters_in_config as check_tied_parameters_in_config,
        clean_state_dict_for_safetensors as clean_state_dict_for_safetensors,
        compile_regions as compile_regions,
        compile_regions_deepspeed as compile_regions_deepspeed,
        compile_regions_fsdp2 as compile_regions_fsdp2,
        convert_bytes as convert_bytes,
        extract_model_from_parallel as extract_model_from_parallel,
        get_fsdp2_grad_scaler as get_fsdp2_grad_scaler,
        get_grad_scaler as get_grad_scaler,
        get_model_tp_size as get_model_tp_size,
        get_module_children_bottom_up as get_module_children_bottom_up,
        get_pretty_name as get_pretty_name,
        has_4bit_bnb_layers as has_4bit_bnb_layers,
        has_ao_layers as has_ao_layers,
        has_compiled_regions as has_compiled_regions,
        has_transformer_engine_layers as has_transformer_engine_layers,
        merge_dicts as merge_dicts,
        model_has_dtensor as model_has_dtensor,
        recursive_getattr as recursive_getattr,
        torchao_required as torchao_required,
    )
    from hasten.base.serialization import (
        load as load,
        save_atomically as save_atomically,
    )
    from hasten.base.sizes import convert_file_size_to_int as convert_file_size_to_int
    from hasten.base.unsupported import (
        AbstractTrainStep as AbstractTrainStep,
        BertTrainStep as BertTrainStep,
        BnbQuantizationConfig as BnbQuantizationConfig,
        DeepSpeedSequenceParallelConfig as DeepSpeedSequenceParallelConfig,
        GPTTrainStep as GPTTrainStep,
        MegatronLMDummyDataLoader as MegatronLMDummyDataLoader,
        MegatronLMDummyScheduler as MegatronLMDummyScheduler,
        MegatronLMPlugin as MegatronLMPlugin,
        T5TrainStep as T5TrainStep,
        add_model_config_to_megatron_parser as add_model_config_to_megatron_parser,
        apply_fp8_autowrap as apply_fp8_autowrap,
        avg_losses_across_data_parallel_group as avg_losses_across_data_parallel_group,
        contextual_fp8_autocast as contextual_fp8_autocast,
        convert_model as convert_model,
        install_xla as install_xla,
        load_and_quantize_model as load_and_quantize_model,
        prepare_deepspeed_cmd_env as prepare_deepspeed_cmd_env,
        prepare_sagemager_args_inputs as prepare_sagemager_args_inputs,
        prepare_tpu as prepare_tpu,
    )
    from hasten.big_modeling import (
        AlignDevicesHook as AlignDevicesHook,
        CpuOffload as CpuOffload,
        ModelHook as ModelHook,
        OffloadedWeightsLoader as OffloadedWeightsLoader,
        PrefixedDataset as PrefixedDataset,
        SequentialHook as SequentialHook,
        UserCpuOffloadHook as UserCpuOffloadHook,
        add_hook_to_module as add_hook_to_module,
        align_module_device as align_module_device,
        attach_align_device_hook as attach_align_device_hook,
        attach_align_device_hook_on_blocks as attach_align_device_hook_on_blocks,
        attach_execution_device_hook as attach_execution_device_hook,
        calculate_maximum_sizes as calculate_maximum_sizes,
        check_device_map as check_device_map,
        check_tied_parameters_on_same_device as check_tied_parameters_on_same_device,
        compute_module_sizes as compute_module_sizes,
        compute_module_total_buffer_size as compute_module_total_buffer_size,
        dtype_byte_size as dtype_byte_size,
        ensure_weights_retied as ensure_weights_retied,
        extract_submodules_state_dict as extract_submodules_state_dict,
        find_tied_parameters as find_tied_parameters,
        get_balanced_memory as get_balanced_memory,
        get_max_layer_size as get_max_layer_size,
        get_max_memory as get_max_memory,
        get_state_dict_offloaded_model as get_state_dict_offloaded_model,
        has_offloaded_params as has_offloaded_params,
        id_tensor_storage as id_tensor_storage,
        infer_auto_device_map as infer_auto_device_map,
        load_checkpoint_in_model as load_checkpoint_in_model,
        load_offloaded_weight as load_offloaded_weight,
        load_offloaded_weights as load_offloaded_weights,
        load_state_dict as load_state_dict,
        named_module_tensors as named_module_tensors,
        offload_state_dict as offload_state_dict,
        offload_weight as offload_weight,
        remove_hook_from_module as remove_hook_from_module,
        remove_hook_from_submodules as remove_hook_from_submodules,
        retie_parameters as retie_parameters,
        save_offload_index as save_offload_index,
        set_module_tensor_to_device as set_module_tensor_to_device,
    )
    from hasten.checkpointing.custom import load_custom_state as load_custom_state
    from hasten.checkpointing.dcp import merge_fsdp_weights as merge_fsdp_weights
    from hasten.checkpointing.fsdp_files import (
        load_fsdp_model as load_fsdp_model,
        load_fsdp_optimizer as load_fsdp_optimizer,
        save_fsdp_model as save_fsdp_model,
        save_fsdp_optimizer as save_fsdp_optimizer,
    )
    from hasten.commands.launch_env import (
        prepare_multi_gpu_env as prepare_multi_gpu_env,
        prepare_simple_launcher_cmd_env as prepare_simple_launcher_cmd_env,
    )
    from hasten.config.io import write_basic_config as write_basic_config
    from hasten.config.plugins.deepspeed import (
        DeepSpeedPlugin as DeepSpeedPlugin,
        get_active_deepspeed_plugin as get_active_deepspeed_plugin,
        map_pytorch_optim_to_deepspeed as map_pytorch_optim_to_deepspeed,
    )
    from hasten.config.plugins.fsdp import FullyShardedDataParallelPlugin as FullyShardedDataParallelPlugin
    from hasten.exceptions import DistributedOperationException as DistributedOperationException
    from hasten.launchers.compat import PrepareForLaunch as PrepareForLaunch
    from hasten.logging import get_logger as get_logger
    from hasten.ops.collectives import (
        CannotPadNestedTensorWarning as CannotPadNestedTensorWarning,
        broadcast as broadcast,
        broadcast_object_list as broadcast_object_list,
        gather as gather,
        gather_object as gather_object,
        pad_across_processes as pad_across_processes,
        pad_input_tensors as pad_input_tensors,
        reduce as reduce,
    )
    from hasten.ops.compat import (
        GatheredParameters as GatheredParameters,
        TensorInformation as TensorInformation,
        convert_outputs_to_fp32 as convert_outputs_to_fp32,
        copy_tensor_to_devices as copy_tensor_to_devices,
        initialize_tensors as initialize_tensors,
        is_tensor_information as is_tensor_information,
    )
    from hasten.ops.random import (
        set_seed as set_seed,
        synchronize_rng_state as synchronize_rng_state,
        synchronize_rng_states as synchronize_rng_states,
    )
    from hasten.ops.tree import (
        concatenate as concatenate,
        convert_to_fp32 as convert_to_fp32,
        find_batch_size as find_batch_size,
        find_device as find_device,
        get_data_structure as get_data_structure,
        honor_type as honor_type,
        ignorant_find_batch_size as ignorant_find_batch_size,
        is_namedtuple as is_namedtuple,
        is_torch_tensor as is_torch_tensor,
        listify as listify,
        recursively_apply as recursively_apply,
        send_to_device as send_to_device,
        slice_tensors as slice_tensors,
    )
    from hasten.optim import (
        DeepSpeedOptimizerWrapper as DeepSpeedOptimizerWrapper,
        DeepSpeedSchedulerWrapper as DeepSpeedSchedulerWrapper,
    )
    from hasten.parallelism_config import (
        ParallelismConfig as ParallelismConfig,
        TorchContextParallelConfig as TorchContextParallelConfig,
        TorchTensorParallelConfig as TorchTensorParallelConfig,
    )
    from hasten.state import wait_for_everyone as wait_for_everyone
    from hasten.state_helpers import (
        deepspeed_required as deepspeed_required,
        get_mixed_precision_context_manager as get_mixed_precision_context_manager,
        save as save,
        save_custom_state as save_custom_state,
    )
    from hasten.strategies.deepspeed import DeepSpeedEngineWrapper as DeepSpeedEngineWrapper
    from hasten.tracking import (
        filter_trackers as filter_trackers,
        get_available_trackers as get_available_trackers,
    )

__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))


# Eager on purpose: once `hasten.utils.tqdm` (the module) is imported, a lazy attribute would resolve to
# the module instead of the function.
from hasten.utils.tqdm import tqdm as tqdm  # noqa: E402
