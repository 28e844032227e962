"""The names each Accelerate module shows but defines elsewhere (its imports: ``accelerate.checkpointing``
shows ``MODEL_NAME`` from ``accelerate.utils.constants``), as hasten paths: hasten module -> name -> the
hasten module at the path where Accelerate defines it. ``hasten._lazy``'s module ``__getattr__`` functions
look a missing name up here, so the name resolves to the one definition on first use.

Written by ``tools/accelerate_inventory.py`` from an installed Accelerate (its ``shown`` table); do not edit.
"""

from __future__ import annotations


def _names(module: str, names: str) -> dict[str, str]:
    return dict.fromkeys(names.split(), module)


SHOWN: dict[str, dict[str, str]] = {
    "hasten.big_modeling": {
        **_names("hasten.hooks", "AlignDevicesHook CpuOffload LayerwiseCastingHook UserCpuOffloadHook "
                                 "add_hook_to_module attach_align_device_hook "
                                 "attach_align_device_hook_on_blocks"),
        **_names("hasten.utils.constants", "SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING"),
        **_names("hasten.utils.environment", "check_cuda_p2p_ib_support parse_flag_from_env"),
        **_names("hasten.utils.imports", "is_bnb_available"),
        **_names("hasten.utils.modeling", "check_device_map find_tied_parameters get_balanced_memory "
                                          "infer_auto_device_map load_checkpoint_in_model retie_parameters"),
        **_names("hasten.utils.offload", "OffloadedWeightsLoader extract_submodules_state_dict "
                                         "offload_state_dict"),
        **_names("hasten.utils.other", "recursive_getattr"),
    },
    "hasten.checkpointing": {
        **_names("hasten.logging", "get_logger"),
        **_names("hasten.state", "PartialState"),
        **_names("hasten.utils.constants", "MODEL_NAME OPTIMIZER_NAME RNG_STATE_NAME SAFE_MODEL_NAME "
                                           "SAFE_WEIGHTS_NAME SAMPLER_NAME SCALER_NAME SCHEDULER_NAME "
                                           "WEIGHTS_NAME"),
        **_names("hasten.utils.imports", "is_cuda_available"),
        **_names("hasten.utils.other", "get_pretty_name load save"),
        **_names("hasten.utils.versions", "is_torch_version"),
    },
    "hasten.commands.accelerate_cli": {
        **_names("hasten.commands.config", "get_config_parser"),
        **_names("hasten.commands.env", "env_command_parser"),
        **_names("hasten.commands.estimate", "estimate_command_parser"),
        **_names("hasten.commands.launch", "launch_command_parser"),
        **_names("hasten.commands.merge", "merge_command_parser"),
        **_names("hasten.commands.test", "test_command_parser"),
        **_names("hasten.commands.to_fsdp2", "to_fsdp2_command_parser"),
        **_names("hasten.commands.tpu", "tpu_command_parser"),
    },
    "hasten.commands.config": {
        **_names("hasten.commands.config.config", "config_command_parser"),
        **_names("hasten.commands.config.config_args", "load_config_from_file"),
        **_names("hasten.commands.config.default", "default_command_parser"),
        **_names("hasten.commands.config.update", "update_command_parser"),
    },
    "hasten.commands.config.cluster": {
        **_names("hasten.commands.config.config_args", "ClusterConfig"),
        **_names("hasten.commands.config.config_utils", "DYNAMO_BACKENDS"),
        **_names("hasten.utils.constants", "DEEPSPEED_MULTINODE_LAUNCHERS FSDP2_STATE_DICT_TYPE "
                                           "FSDP_AUTO_WRAP_POLICY FSDP_BACKWARD_PREFETCH "
                                           "FSDP_SHARDING_STRATEGY FSDP_STATE_DICT_TYPE TORCH_DYNAMO_MODES"),
        **_names("hasten.utils.dataclasses", "ComputeEnvironment DistributedType"),
        **_names("hasten.utils.imports", "is_deepspeed_available is_fp8_available is_mps_available "
                                         "is_msamp_available is_torchao_available "
                                         "is_transformer_engine_available is_transformers_available"),
    },
    "hasten.commands.config.config": {
        **_names("hasten.commands.config.cluster", "get_cluster_input"),
        **_names("hasten.commands.config.config_args", "cache_dir default_yaml_config_file "
                                                       "load_config_from_file"),
        **_names("hasten.commands.config.sagemaker", "get_sagemaker_input"),
        **_names("hasten.utils.dataclasses", "ComputeEnvironment"),
    },
    "hasten.commands.config.config_args": {
        **_names("hasten.utils.constants", "SAGEMAKER_PYTHON_VERSION SAGEMAKER_PYTORCH_VERSION "
                                           "SAGEMAKER_TRANSFORMERS_VERSION"),
        **_names("hasten.utils.dataclasses", "ComputeEnvironment DistributedType SageMakerDistributedType"),
    },
    "hasten.commands.config.config_utils": {
        **_names("hasten.utils.dataclasses", "ComputeEnvironment DistributedType DynamoBackend "
                                             "FP8BackendType PrecisionType SageMakerDistributedType"),
    },
    "hasten.commands.config.default": {
        **_names("hasten.commands.config.config_args", "ClusterConfig default_json_config_file"),
        **_names("hasten.commands.config.config_utils", "SubcommandHelpFormatter"),
    },
    "hasten.commands.config.sagemaker": {
        **_names("hasten.commands.config.config_args", "SageMakerConfig"),
        **_names("hasten.commands.config.config_utils", "DYNAMO_BACKENDS"),
        **_names("hasten.utils.constants", "SAGEMAKER_PARALLEL_EC2_INSTANCES TORCH_DYNAMO_MODES"),
        **_names("hasten.utils.dataclasses", "ComputeEnvironment SageMakerDistributedType"),
        **_names("hasten.utils.imports", "is_boto3_available"),
    },
    "hasten.commands.config.update": {
        **_names("hasten.commands.config.config_args", "load_config_from_file"),
        **_names("hasten.commands.config.config_utils", "SubcommandHelpFormatter"),
    },
    "hasten.commands.env": {
        **_names("hasten.commands.config.config_args", "load_config_from_file"),
        **_names("hasten.utils.imports", "is_mps_available"),
    },
    "hasten.commands.estimate": {
        **_names("hasten.big_modeling", "init_empty_weights"),
        **_names("hasten.utils.imports", "is_timm_available is_transformers_available"),
        **_names("hasten.utils.modeling", "calculate_maximum_sizes"),
        **_names("hasten.utils.other", "convert_bytes"),
    },
    "hasten.commands.launch": {
        **_names("hasten.commands.config.config_args", "SageMakerConfig load_config_from_file"),
        **_names("hasten.commands.config.config_utils", "DYNAMO_BACKENDS"),
        **_names("hasten.utils.constants", "DEEPSPEED_MULTINODE_LAUNCHERS TORCH_DYNAMO_MODES"),
        **_names("hasten.utils.dataclasses", "ComputeEnvironment DistributedType"),
        **_names("hasten.utils.environment", "check_cuda_p2p_ib_support convert_dict_to_env_variables "
                                             "get_int_from_env patch_environment str_to_bool"),
        **_names("hasten.utils.imports", "is_bf16_available is_deepspeed_available is_rich_available "
                                         "is_sagemaker_available"),
        **_names("hasten.utils.launch", "PrepareForLaunch prepare_deepspeed_cmd_env prepare_multi_gpu_env "
                                        "prepare_sagemager_args_inputs prepare_simple_launcher_cmd_env "
                                        "prepare_tpu"),
    },
    "hasten.commands.merge": {
        **_names("hasten.utils.fsdp_utils", "merge_fsdp_weights"),
    },
    "hasten.commands.test": {
        **_names("hasten.test_utils.testing", "execute_subprocess_async path_in_accelerate_package"),
    },
    "hasten.commands.tpu": {
        **_names("hasten.commands.config.config_args", "load_config_from_file"),
    },
    "hasten.data_loader": {
        **_names("hasten.logging", "get_logger"),
        **_names("hasten.state", "GradientState PartialState"),
        **_names("hasten.utils.dataclasses", "DistributedType RNGType"),
        **_names("hasten.utils.imports", "is_datasets_available is_torchdata_stateful_dataloader_available"),
        **_names("hasten.utils.operations", "broadcast broadcast_object_list concatenate find_batch_size "
                                            "get_data_structure initialize_tensors send_to_device "
                                            "slice_tensors"),
        **_names("hasten.utils.random", "synchronize_rng_states"),
        **_names("hasten.utils.versions", "compare_versions is_torch_version"),
    },
    "hasten.hooks": {
        **_names("hasten.state", "PartialState"),
        **_names("hasten.utils.memory", "clear_device_cache"),
        **_names("hasten.utils.modeling", "get_non_persistent_buffers named_module_tensors "
                                          "set_module_tensor_to_device"),
        **_names("hasten.utils.offload", "PrefixedDataset"),
        **_names("hasten.utils.operations", "find_device send_to_device"),
        **_names("hasten.utils.other", "recursive_getattr"),
    },
    "hasten.inference": {
        **_names("hasten.state", "PartialState"),
        **_names("hasten.utils.imports", "is_pippy_available"),
        **_names("hasten.utils.modeling", "calculate_maximum_sizes infer_auto_device_map"),
        **_names("hasten.utils.operations", "copy_tensor_to_devices ignorant_find_batch_size "
                                            "pad_input_tensors send_to_device"),
        **_names("hasten.utils.other", "convert_bytes"),
    },
    "hasten.launchers": {
        **_names("hasten.state", "AcceleratorState PartialState"),
        **_names("hasten.utils.constants", "ELASTIC_LOG_LINE_PREFIX_TEMPLATE_PYTORCH_VERSION"),
        **_names("hasten.utils.dataclasses", "PrecisionType"),
        **_names("hasten.utils.environment", "are_libraries_initialized check_cuda_p2p_ib_support "
                                             "get_current_device_type get_gpu_info patch_environment"),
        **_names("hasten.utils.imports", "is_mps_available is_rocm_available"),
        **_names("hasten.utils.launch", "PrepareForLaunch"),
        **_names("hasten.utils.versions", "is_torch_version"),
    },
    "hasten.local_sgd": {
        **_names("hasten.accelerator", "Accelerator"),
        **_names("hasten.utils.dataclasses", "DistributedType"),
    },
    "hasten.logging": {
        **_names("hasten.state", "PartialState"),
    },
    "hasten.optimizer": {
        **_names("hasten.state", "AcceleratorState GradientState"),
        **_names("hasten.utils.dataclasses", "DistributedType"),
        **_names("hasten.utils.imports", "is_lomo_available"),
        **_names("hasten.utils.operations", "honor_type"),
    },
    "hasten.parallelism_config": {
        **_names("hasten.utils.dataclasses", "DeepSpeedSequenceParallelConfig DistributedType "
                                             "TorchContextParallelConfig TorchTensorParallelConfig"),
        **_names("hasten.utils.versions", "is_torch_version"),
    },
    "hasten.scheduler": {
        **_names("hasten.state", "AcceleratorState GradientState"),
    },
    "hasten.state": {
        **_names("hasten.utils.dataclasses", "DistributedType DynamoBackend GradientAccumulationPlugin "
                                             "SageMakerDistributedType"),
        **_names("hasten.utils.environment", "check_cuda_p2p_ib_support get_cpu_distributed_information "
                                             "get_int_from_env parse_choice_from_env parse_flag_from_env"),
        **_names("hasten.utils.imports", "deepspeed_required is_datasets_available is_deepspeed_available "
                                         "is_fp8_available is_habana_gaudi1 is_mps_available "
                                         "is_xccl_available"),
    },
    "hasten.test_utils.testing": {
        **_names("hasten.state", "AcceleratorState GradientState"),
        **_names("hasten.utils.environment", "str_to_bool"),
        **_names("hasten.utils.imports", "is_aim_available is_bnb_available is_clearml_available "
                                         "is_comet_ml_available is_cuda_available is_datasets_available "
                                         "is_deepspeed_available is_dvclive_available is_fp16_available "
                                         "is_fp8_available is_habana_gaudi1 is_import_timer_available "
                                         "is_matplotlib_available is_mlflow_available is_mps_available "
                                         "is_pandas_available is_peft_available is_pippy_available "
                                         "is_pytest_available is_schedulefree_available "
                                         "is_swanlab_available is_tensorboard_available is_timm_available "
                                         "is_torchao_available is_torchdata_stateful_dataloader_available "
                                         "is_torchvision_available is_trackio_available "
                                         "is_transformer_engine_available "
                                         "is_transformer_engine_mxfp8_available is_transformers_available "
                                         "is_triton_available is_wandb_available"),
        **_names("hasten.utils.operations", "gather"),
        **_names("hasten.utils.versions", "compare_versions is_torch_version"),
    },
    "hasten.test_utils.training": {
        **_names("hasten.utils.dataclasses", "DistributedType"),
    },
    "hasten.tracking": {
        **_names("hasten.logging", "get_logger"),
        **_names("hasten.state", "PartialState"),
        **_names("hasten.utils.dataclasses", "LoggerType"),
        **_names("hasten.utils.environment", "str_to_bool"),
        **_names("hasten.utils.imports", "is_aim_available is_clearml_available is_comet_ml_available "
                                         "is_dvclive_available is_mlflow_available is_swanlab_available "
                                         "is_tensorboard_available is_trackio_available is_wandb_available"),
        **_names("hasten.utils.operations", "listify"),
        **_names("hasten.utils.versions", "compare_versions"),
    },
    "hasten.utils.ao": {
        **_names("hasten.utils.imports", "is_torchao_available torchao_required"),
    },
    "hasten.utils.bnb": {
        **_names("hasten.big_modeling", "dispatch_model init_empty_weights"),
        **_names("hasten.utils.dataclasses", "BnbQuantizationConfig"),
        **_names("hasten.utils.imports", "is_4bit_bnb_available is_8bit_bnb_available"),
        **_names("hasten.utils.modeling", "find_tied_parameters get_balanced_memory infer_auto_device_map "
                                          "load_checkpoint_in_model set_module_tensor_to_device"),
        **_names("hasten.utils.offload", "offload_weight"),
    },
    "hasten.utils.dataclasses": {
        **_names("hasten.utils.constants", "BETA_CP_AVAILABLE_PYTORCH_VERSION "
                                           "BETA_TP_AVAILABLE_PYTORCH_VERSION "
                                           "BETA_TP_AVAILABLE_TRANSFORMERS_VERSION FSDP2_PYTORCH_VERSION "
                                           "FSDP_AUTO_WRAP_POLICY FSDP_BACKWARD_PREFETCH "
                                           "FSDP_SHARDING_STRATEGY MITA_PROFILING_AVAILABLE_PYTORCH_VERSION "
                                           "XPU_PROFILING_AVAILABLE_PYTORCH_VERSION"),
        **_names("hasten.utils.environment", "parse_flag_from_env str_to_bool"),
        **_names("hasten.utils.imports", "is_cuda_available is_msamp_available is_rocm_available "
                                         "is_torchao_available is_transformer_engine_available"),
        **_names("hasten.utils.versions", "compare_versions is_torch_version"),
    },
    "hasten.utils.deepspeed": {
        **_names("hasten.optimizer", "AcceleratedOptimizer"),
        **_names("hasten.scheduler", "AcceleratedScheduler"),
        **_names("hasten.utils.dataclasses", "DistributedType"),
        **_names("hasten.utils.imports", "is_bnb_available"),
        **_names("hasten.utils.versions", "compare_versions"),
    },
    "hasten.utils.fsdp_utils": {
        **_names("hasten.logging", "get_logger"),
        **_names("hasten.utils.constants", "FSDP_MODEL_NAME OPTIMIZER_NAME SAFE_WEIGHTS_NAME WEIGHTS_NAME"),
        **_names("hasten.utils.dataclasses", "get_module_class_from_name"),
        **_names("hasten.utils.modeling", "get_non_persistent_buffers is_peft_model"),
        **_names("hasten.utils.other", "get_module_children_bottom_up is_compiled_module save"),
        **_names("hasten.utils.versions", "is_torch_version"),
    },
    "hasten.utils.imports": {
        **_names("hasten.utils.environment", "parse_flag_from_env patch_environment str_to_bool"),
        **_names("hasten.utils.versions", "compare_versions is_torch_version"),
    },
    "hasten.utils.launch": {
        **_names("hasten.commands.config.config_args", "SageMakerConfig"),
        **_names("hasten.utils.constants", "DEEPSPEED_MULTINODE_LAUNCHERS"),
        **_names("hasten.utils.dataclasses", "DistributedType DynamoBackend PrecisionType "
                                             "SageMakerDistributedType"),
        **_names("hasten.utils.environment", "str_to_bool"),
        **_names("hasten.utils.imports", "is_fp8_available"),
        **_names("hasten.utils.other", "get_free_port is_port_in_use merge_dicts"),
        **_names("hasten.utils.versions", "compare_versions"),
    },
    "hasten.utils.megatron_lm": {
        **_names("hasten.optimizer", "AcceleratedOptimizer"),
        **_names("hasten.scheduler", "AcceleratedScheduler"),
        **_names("hasten.utils.imports", "is_megatron_lm_available"),
        **_names("hasten.utils.operations", "recursively_apply send_to_device"),
    },
    "hasten.utils.memory": {
        **_names("hasten.utils.imports", "is_cuda_available is_mps_available"),
    },
    "hasten.utils.modeling": {
        **_names("hasten.state", "AcceleratorState"),
        **_names("hasten.utils.constants", "SAFE_WEIGHTS_NAME WEIGHTS_NAME"),
        **_names("hasten.utils.dataclasses", "AutocastKwargs CustomDtype DistributedType"),
        **_names("hasten.utils.imports", "is_mps_available is_peft_available is_tqdm_available"),
        **_names("hasten.utils.memory", "clear_device_cache"),
        **_names("hasten.utils.offload", "load_offloaded_weight offload_weight save_offload_index"),
        **_names("hasten.utils.tqdm", "tqdm"),
        **_names("hasten.utils.versions", "is_torch_version"),
    },
    "hasten.utils.operations": {
        **_names("hasten.state", "AcceleratorState PartialState"),
        **_names("hasten.utils.constants", "TORCH_DISTRIBUTED_OPERATION_TYPES"),
        **_names("hasten.utils.dataclasses", "DistributedType TensorInformation"),
        **_names("hasten.utils.imports", "is_torch_distributed_available"),
        **_names("hasten.utils.versions", "is_torch_version"),
    },
    "hasten.utils.other": {
        **_names("hasten.commands.config.default", "write_basic_config"),
        **_names("hasten.logging", "get_logger"),
        **_names("hasten.state", "PartialState"),
        **_names("hasten.utils.constants", "FSDP_PYTORCH_VERSION"),
        **_names("hasten.utils.dataclasses", "DistributedType"),
        **_names("hasten.utils.imports", "is_deepspeed_available is_numpy_available "
                                         "is_torch_distributed_available is_weights_only_available"),
        **_names("hasten.utils.modeling", "id_tensor_storage"),
        **_names("hasten.utils.transformer_engine", "convert_model"),
        **_names("hasten.utils.versions", "is_torch_version"),
    },
    "hasten.utils.random": {
        **_names("hasten.state", "AcceleratorState"),
        **_names("hasten.utils.constants", "CUDA_DISTRIBUTED_TYPES"),
        **_names("hasten.utils.dataclasses", "DistributedType RNGType"),
    },
    "hasten.utils.tqdm": {
        **_names("hasten.state", "PartialState"),
        **_names("hasten.utils.imports", "is_tqdm_available"),
    },
    "hasten.utils.transformer_engine": {
        **_names("hasten.utils.imports", "is_transformer_engine_available"),
        **_names("hasten.utils.operations", "GatheredParameters"),
    },
    "hasten.utils.versions": {
        **_names("hasten.utils.constants", "STR_OPERATION_TO_FUNC"),
    },
}
