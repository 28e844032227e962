"""Accelerate's names for products hasten does not run (Megatron-LM, TPUs, SageMaker, bitsandbytes,
Transformer Engine / MS-AMP, tensor/context/sequence parallel plugins).

Importing them works; constructing or calling one raises a ``ConfigurationError`` naming what to use
instead (see :mod:`hasten.utils.refusals`). The migrating guide lists them in one table.
"""

from __future__ import annotations

from hasten.utils.refusals import (
    ACCELERATE_LAUNCHER,
    BNB,
    CHECKPOINT_INTERNALS,
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
TorchTensorParallelPlugin = refused_class("TorchTensorParallelPlugin", "tp_size torch_device_mesh", ND_PARALLEL)
DeepSpeedSequenceParallelConfig = refused_class("DeepSpeedSequenceParallelConfig", "sp_seq_length sp_seq_length_is_variable sp_attn_implementation", ND_PARALLEL)
contextual_fp8_autocast = refused_function("contextual_fp8_autocast", "model_forward fp8_recipe use_during_eval",
                                           TRANSFORMER_ENGINE)
save_accelerator_state = refused_function(
    "save_accelerator_state", "output_dir model_states optimizers schedulers dataloaders process_index step scaler "
    "save_on_each_node safe_serialization", CHECKPOINT_INTERNALS)
load_accelerator_state = refused_function(
    "load_accelerator_state", "input_dir models optimizers schedulers dataloaders process_index scaler map_location "
    "load_kwargs load_model_func_kwargs", CHECKPOINT_INTERNALS)
prepare_deepspeed_cmd_env = refused_function("prepare_deepspeed_cmd_env", "args", ACCELERATE_LAUNCHER)
prepare_multi_gpu_env = refused_function("prepare_multi_gpu_env", "args", ACCELERATE_LAUNCHER)
prepare_simple_launcher_cmd_env = refused_function("prepare_simple_launcher_cmd_env", "args", ACCELERATE_LAUNCHER)
