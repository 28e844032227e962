"""Where each name of an Accelerate module lives in hasten, for the names that module path shows but hasten
defines elsewhere (Accelerate's ``accelerate.utils.modeling`` holds what hasten keeps in ``big_modeling``).

Each hasten module at one of Accelerate's paths ends with
``__getattr__ = accelerate_path_getattr(__name__, globals())``: a name missing there is looked up here and
imported from its one definition on first use (no second copy; ``import hasten`` stays cheap, because
nothing here is imported before a name is asked for). ``tests/accelerate_compat/test_accelerate_modules.py`` checks the
paths against Accelerate's own modules.
"""

from __future__ import annotations

_B = "hasten.big_modeling"
_REFUSED = "hasten.base.unsupported"


def _names(module: str, names: str) -> dict[str, str]:
    return dict.fromkeys(names.split(), module)


PATHS: dict[str, dict[str, str]] = {
    "hasten.checkpointing": {
        **_names("hasten.checkpointing.custom", "load_custom_state"),
        **_names("hasten.state_helpers", "save_custom_state"),
        **_names("hasten.accelerator_state_files", "save_accelerator_state load_accelerator_state"),
    },
    "hasten.utils.ao": {
        **_names("hasten.base.fp8", "convert_model_to_fp8_ao filter_first_and_last_linear_layers "
                                     "filter_linear_layers find_first_last_linear_layers"),
        "has_ao_layers": "hasten.base.modeling",
    },
    "hasten.utils.bnb": {
        "has_4bit_bnb_layers": "hasten.base.modeling",
        **_names(_REFUSED, "load_and_quantize_model get_keys_to_not_convert get_parameter_device "
                           "get_quantized_model_device_map quantize_and_offload_8bit replace_with_bnb_layers"),
    },
    "hasten.base.dataclasses": {
        **_names("hasten.base.fp8", "AORecipeKwargs FP8BackendType FP8RecipeKwargs MSAMPRecipeKwargs TERecipeKwargs"),
        **_names("hasten.base.constants", "CustomDtype SageMakerDistributedType"),
        "DeepSpeedPlugin": "hasten.config.plugins.deepspeed",
        "FullyShardedDataParallelPlugin": "hasten.config.plugins.fsdp",
        "TensorInformation": "hasten.ops.compat",
        **_names("hasten.config.parallelism", "TorchContextParallelConfig TorchTensorParallelConfig"),
        **_names("hasten.base.unsupported", "BnbQuantizationConfig DeepSpeedSequenceParallelConfig MegatronLMPlugin"),
        **_names(_REFUSED, "add_model_config_to_megatron_parser MODEL_CONFIGS_TO_MEGATRON_PARSERS parse_bert_config "
                           "parse_glm4_moe_config parse_gpt2_config parse_llama_config parse_t5_config"),
        "get_module_class_from_name": "hasten.base.modeling",
    },
    "hasten.base.deepspeed": {
        "DeepSpeedEngineWrapper": "hasten.strategies.deepspeed",
        **_names("hasten.optim", "DeepSpeedOptimizerWrapper DeepSpeedSchedulerWrapper"),
        **_names("hasten.config.plugins.deepspeed", "get_active_deepspeed_plugin map_pytorch_optim_to_deepspeed"),
    },
    "hasten.base.environment": {
        "are_libraries_initialized": "hasten.base.modeling",
    },
    "hasten.base.imports": {
        "deepspeed_required": "hasten.state_helpers",
        "torchao_required": "hasten.base.modeling",
        "USE_TORCH_XLA": "hasten.base.environment",
    },
    "hasten.utils.launch": {
        "PrepareForLaunch": "hasten.launchers.compat",
        "env_var_path_add": "hasten.base.environment",
        **_names("hasten.commands.launch_env", "prepare_multi_gpu_env prepare_simple_launcher_cmd_env "
                                               "_convert_nargs_to_dict"),
        **_names(_REFUSED, "prepare_deepspeed_cmd_env prepare_sagemager_args_inputs "
                           "prepare_tpu prepare_extend_env_parallelism_config "
                           "setup_fp8_env"),
    },
    "hasten.utils.megatron_lm": {
        **_names("hasten.base.unsupported", "AbstractTrainStep BertTrainStep GPTTrainStep MegatronLMDummyDataLoader "
                                             "MegatronLMDummyScheduler T5TrainStep"),
        **_names(_REFUSED, "avg_losses_across_data_parallel_group MegatronEngine MegatronLMOptimizerWrapper "
                           "MegatronLMSchedulerWrapper finish_mpu_init gather_across_data_parallel_groups initialize "
                           "model_provider_func prepare_model_optimizer_scheduler prepare_optimizer prepare_scheduler"),
        "prepare_data_loader": "hasten.data.prepare",
    },
    "hasten.base.modeling": {
        "WEIGHTS_INDEX_NAME": "hasten.base.constants",
        "get_mixed_precision_context_manager": "hasten.state_helpers",
        "convert_file_size_to_int": "hasten.base.sizes",
        "is_peft_model": "hasten.base.imports",
        **_names("hasten.big_modeling.allocation", "check_device_same fallback_allocate get_module_leaves "
                                                   "get_module_size_with_ties get_state_dict_from_offload"),
        "get_non_persistent_buffers": "hasten.big_modeling.tensors",
        "clean_device_map": "hasten.big_modeling.device_map",
        **_names(_B, "align_module_device calculate_maximum_sizes check_device_map "
                     "check_tied_parameters_on_same_device compute_module_sizes "
                     "compute_module_total_buffer_size dtype_byte_size find_tied_parameters "
                     "get_balanced_memory get_max_layer_size get_max_memory "
                     "get_state_dict_offloaded_model has_offloaded_params id_tensor_storage infer_auto_device_map "
                     "load_checkpoint_in_model load_offloaded_weights load_state_dict named_module_tensors "
                     "retie_parameters set_module_tensor_to_device"),
    },
    "hasten.utils.offload": _names("hasten.big_modeling.offload", "OffloadedWeightsLoader PrefixedDataset "
                                   "extract_submodules_state_dict load_offloaded_weight offload_state_dict "
                                   "offload_weight save_offload_index"),
    "hasten.utils.other": {
        "wait_for_everyone": "hasten.state",
        **_names("hasten.base.modeling", "check_os_kernel clean_state_dict_for_safetensors compile_regions "
                                          "compile_regions_deepspeed compile_regions_fsdp2 convert_bytes "
                                          "extract_model_from_parallel get_model_tp_size get_module_children_bottom_up "
                                          "get_pretty_name has_compiled_regions has_repeated_blocks is_repeated_blocks "
                                          "merge_dicts model_has_dtensor recursive_getattr get_module_class_from_name"),
        "TORCH_SAFE_GLOBALS": "hasten.base.modeling",
        **_names("hasten.base.imports", "is_compiled_module is_port_in_use get_free_port"),
        "load": "hasten.base.serialization",
        "save": "hasten.state_helpers",
    },
    "hasten.utils.random": _names("hasten.ops.random", "set_seed synchronize_rng_state synchronize_rng_states"),
    "hasten.utils.torch_xla": {"install_xla": _REFUSED},
    "hasten.utils.transformer_engine": {
        **_names(_REFUSED, "apply_fp8_autowrap contextual_fp8_autocast convert_model"),
        "has_transformer_engine_layers": "hasten.base.modeling",
    },
    "hasten.test_utils.testing": {"parse_flag_from_env": "hasten.base.environment"},
    "hasten.commands.launch": {
        **_names("hasten.commands.launch_compat", "CustomHelpFormatter clean_option deepspeed_launcher "
                                                  "multi_gpu_launcher options_to_group simple_launcher"),
        **_names(_REFUSED, "sagemaker_launcher tpu_launcher tpu_pod_launcher"),
        "_validate_launch_command": "hasten.commands.launch_env",
    },
}
