"""Accelerate's names for products hasten does not run (Megatron-LM, TPUs, SageMaker, bitsandbytes,
Transformer Engine / MS-AMP, tensor/context/sequence parallel plugins).

Importing them works; constructing or calling one raises a ``ConfigurationError`` naming what to use
instead (see :mod:`hasten.base.refusals`). The migrating guide lists them in one table.
"""

from __future__ import annotations

from hasten.base.refusals import (
    ACCELERATE_LAUNCHER,
    BNB,
    MEGATRON,
    ND_PARALLEL,
    SAGEMAKER,
    TPU,
    TRANSFORMER_ENGINE,
    refused_class,
    refused_function,
)

MegatronLMPlugin = refused_class("MegatronLMPlugin", "tp_degree pp_degree use_custom_fsdp overlap_cpu_optimizer_d2h_h2d no_load_optim eod_mask_loss no_save_optim optimizer_cpu_offload use_precision_aware_optimizer decoder_last_pipeline_num_layers recompute_granularity recompute_method recompute_num_layers attention_backend expert_model_parallel_size context_parallel_size attention_dropout hidden_dropout attention_softmax_in_fp32 expert_tensor_parallel_size calculate_per_token_loss use_rotary_position_embeddings num_micro_batches gradient_clipping sequence_parallelism recompute_activations use_distributed_optimizer pipeline_model_parallel_split_rank num_layers_per_virtual_pipeline_stage is_train_batch_min train_iters train_samples weight_decay_incr_style start_weight_decay end_weight_decay lr_decay_style lr_decay_iters lr_decay_samples lr_warmup_iters lr_warmup_samples lr_warmup_fraction min_lr consumed_samples no_wd_decay_cond scale_lr_cond lr_mult megatron_dataset_flag seq_length encoder_seq_length decoder_seq_length tensorboard_dir set_all_logging_options eval_iters eval_interval return_logits custom_train_step_class custom_train_step_kwargs custom_model_provider_function custom_prepare_model_function custom_megatron_datasets_provider_function custom_get_batch_function custom_loss_function other_megatron_args", MEGATRON,
    methods="set_mixed_precision mixed_precision; set_network_size_args model batch_data; set_optimizer_type optimizer; set_scheduler_args scheduler; set_tensorboard_logging_options; set_training_args micro_batch_size dp_degree")
MegatronLMDummyDataLoader = refused_class("MegatronLMDummyDataLoader", "dataset_kwargs", MEGATRON,
    methods="build_train_valid_test_data_iterators accelerator; get_train_valid_test_datasets_provider accelerator; set_megatron_data_args")
MegatronLMDummyScheduler = refused_class("MegatronLMDummyScheduler", "optimizer total_num_steps warmup_num_steps kwargs", MEGATRON)
AbstractTrainStep = refused_class("AbstractTrainStep", "name", MEGATRON,
    methods="get_batch_func accelerator megatron_dataset_flag; get_forward_step_func; get_loss_func accelerator")
BertTrainStep = refused_class("BertTrainStep", "accelerator args", MEGATRON,
    methods="get_batch_func accelerator megatron_dataset_flag; get_forward_step_func pretraining_flag bert_binary_head; get_loss_func accelerator pretraining_flag num_labels")
GPTTrainStep = refused_class("GPTTrainStep", "accelerator args", MEGATRON,
    methods="get_batch_func accelerator megatron_dataset_flag; get_forward_step_func; get_loss_func accelerator")
T5TrainStep = refused_class("T5TrainStep", "accelerator args", MEGATRON,
    methods="@attn_mask_postprocess attention_mask; get_batch_func accelerator megatron_dataset_flag; @get_decoder_mask seq_length device; @get_enc_dec_mask attention_mask dec_seq_length device; get_forward_step_func; get_loss_func accelerator")
add_model_config_to_megatron_parser = refused_function("add_model_config_to_megatron_parser", "model_type", MEGATRON)
avg_losses_across_data_parallel_group = refused_function("avg_losses_across_data_parallel_group", "losses", MEGATRON)
install_xla = refused_function("install_xla", "upgrade", TPU)
prepare_tpu = refused_function("prepare_tpu", "args current_env pod", TPU)
prepare_sagemager_args_inputs = refused_function("prepare_sagemager_args_inputs", "sagemaker_config args", SAGEMAKER)
BnbQuantizationConfig = refused_class("BnbQuantizationConfig", "load_in_8bit llm_int8_threshold load_in_4bit bnb_4bit_quant_type bnb_4bit_use_double_quant bnb_4bit_compute_dtype torch_dtype skip_modules keep_in_fp32_modules", BNB)
load_and_quantize_model = refused_function("load_and_quantize_model", "model bnb_quantization_config weights_location device_map no_split_module_classes max_memory offload_folder offload_state_dict", BNB)
convert_model = refused_function("convert_model", "model to_transformer_engine _convert_linear _convert_ln", TRANSFORMER_ENGINE)
apply_fp8_autowrap = refused_function("apply_fp8_autowrap", "model fp8_recipe_handler", TRANSFORMER_ENGINE)
DeepSpeedSequenceParallelConfig = refused_class("DeepSpeedSequenceParallelConfig", "sp_seq_length sp_seq_length_is_variable sp_attn_implementation", ND_PARALLEL)
contextual_fp8_autocast = refused_function("contextual_fp8_autocast", "model_forward fp8_recipe use_during_eval",
                                           TRANSFORMER_ENGINE)
prepare_deepspeed_cmd_env = refused_function("prepare_deepspeed_cmd_env", "args", ACCELERATE_LAUNCHER)

# accelerate.utils.bnb: bitsandbytes quantization
get_keys_to_not_convert = refused_function("get_keys_to_not_convert", "model", BNB)
get_parameter_device = refused_function("get_parameter_device", "parameter", BNB)
get_quantized_model_device_map = refused_function(
    "get_quantized_model_device_map", "model bnb_quantization_config device_map max_memory no_split_module_classes", BNB)
quantize_and_offload_8bit = refused_function(
    "quantize_and_offload_8bit", "model param param_name new_dtype offload_folder offload_index fp16_statistics", BNB)
replace_with_bnb_layers = refused_function(
    "replace_with_bnb_layers", "model bnb_quantization_config modules_to_not_convert current_key_name", BNB)

# accelerate.utils.megatron_lm and the Megatron-LM model-config parsers of accelerate.utils.dataclasses
MegatronEngine = refused_class("MegatronEngine", "accelerator model optimizer scheduler", MEGATRON)
MegatronLMOptimizerWrapper = refused_class("MegatronLMOptimizerWrapper", "optimizer", MEGATRON)
MegatronLMSchedulerWrapper = refused_class("MegatronLMSchedulerWrapper", "scheduler optimizers", MEGATRON)
finish_mpu_init = refused_function("finish_mpu_init", "", MEGATRON)
gather_across_data_parallel_groups = refused_function("gather_across_data_parallel_groups", "tensor", MEGATRON)
initialize = refused_function("initialize", "accelerator extra_args_provider args_defaults", MEGATRON)
model_provider_func = refused_function("model_provider_func", "pre_process post_process add_encoder add_decoder",
                                       MEGATRON)
prepare_model_optimizer_scheduler = refused_function("prepare_model_optimizer_scheduler", "accelerator", MEGATRON)
prepare_optimizer = refused_function("prepare_optimizer", "accelerator model", MEGATRON)
prepare_scheduler = refused_function("prepare_scheduler", "accelerator optimizer scheduler", MEGATRON)
parse_bert_config = refused_function("parse_bert_config", "megatron_lm_plugin model batch_data", MEGATRON)
parse_glm4_moe_config = refused_function("parse_glm4_moe_config", "megatron_lm_plugin model batch_data", MEGATRON)
parse_gpt2_config = refused_function("parse_gpt2_config", "megatron_lm_plugin model batch_data", MEGATRON)
parse_llama_config = refused_function("parse_llama_config", "megatron_lm_plugin model batch_data", MEGATRON)
parse_t5_config = refused_function("parse_t5_config", "megatron_lm_plugin model batch_data", MEGATRON)
MODEL_CONFIGS_TO_MEGATRON_PARSERS = {"megatron-bert": parse_bert_config, "gpt2": parse_gpt2_config,
                                     "t5": parse_t5_config, "llama": parse_llama_config,
                                     "glm4_moe": parse_glm4_moe_config}

# accelerate.utils.launch: the pieces of Accelerate's launcher that write ACCELERATE_* variables
prepare_extend_env_parallelism_config = refused_function("prepare_extend_env_parallelism_config",
                                                         "args current_env", ACCELERATE_LAUNCHER)
setup_fp8_env = refused_function("setup_fp8_env", "args current_env", ACCELERATE_LAUNCHER)

# accelerate.commands.launch: launchers for TPUs and SageMaker
tpu_launcher = refused_function("tpu_launcher", "args", TPU)
tpu_pod_launcher = refused_function("tpu_pod_launcher", "args", TPU)
sagemaker_launcher = refused_function("sagemaker_launcher", "sagemaker_config args", SAGEMAKER)
