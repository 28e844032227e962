"""File names and tables that Accelerate exports from ``accelerate.utils`` (same values)."""

from __future__ import annotations

import enum
import operator
from typing import Any

MODEL_NAME = "pytorch_model"
SAFE_MODEL_NAME = "model"
OPTIMIZER_NAME = "optimizer"
SCHEDULER_NAME = "scheduler"
SAMPLER_NAME = "sampler"
SCALER_NAME = "scaler.pt"
RNG_STATE_NAME = "random_states"
WEIGHTS_NAME = f"{MODEL_NAME}.bin"
WEIGHTS_PATTERN_NAME = "pytorch_model{suffix}.bin"
WEIGHTS_INDEX_NAME = f"{WEIGHTS_NAME}.index.json"
SAFE_WEIGHTS_NAME = f"{SAFE_MODEL_NAME}.safetensors"
SAFE_WEIGHTS_PATTERN_NAME = "model{suffix}.safetensors"
SAFE_WEIGHTS_INDEX_NAME = f"{SAFE_WEIGHTS_NAME}.index.json"
PROFILE_PATTERN_NAME = "profile_{suffix}.json"
MITA_PROFILING_AVAILABLE_PYTORCH_VERSION = "2.1.0"
XPU_PROFILING_AVAILABLE_PYTORCH_VERSION = "2.4.0"

#: Distributed types under which torch.distributed collectives run.
TORCH_DISTRIBUTED_OPERATION_TYPES = ["DEEPSPEED", "MULTI_GPU", "FSDP", "MEGATRON_LM", "TP", "MULTI_NPU", "MULTI_MLU",
                                     "MULTI_SDAA", "MULTI_MUSA", "MULTI_XPU", "MULTI_CPU", "MULTI_HPU", "MULTI_NEURON"]
#: torchrun's own options (``hasten launch`` passes these to torchrun's elastic agent).
TORCH_LAUNCH_PARAMS = ["nnodes", "nproc_per_node", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf", "standalone",
                       "max_restarts", "monitor_interval", "start_method", "role", "module", "m", "no_python",
                       "run_path", "log_dir", "r", "redirects", "t", "tee", "node_rank", "master_addr", "master_port"]


class CustomDtype(enum.Enum):
    """Sizes that torch has no dtype for, used in device-map arithmetic (``dtype_byte_size``)."""

    FP8 = "fp8"
    INT4 = "int4"
    INT2 = "int2"


class SageMakerDistributedType(str, enum.Enum):
    """SageMaker's distributed modes (hasten does not launch on SageMaker; the names exist for configs)."""

    NO = "NO"
    DATA_PARALLEL = "DATA_PARALLEL"
    MODEL_PARALLEL = "MODEL_PARALLEL"

# Accelerate's tables that Transformers reads (``TrainingArguments(fsdp=...)`` checks its options against them).
SAGEMAKER_PYTORCH_VERSION = "1.10.2"
SAGEMAKER_PYTHON_VERSION = "py38"
SAGEMAKER_TRANSFORMERS_VERSION = "4.17.0"
SAGEMAKER_PARALLEL_EC2_INSTANCES = ["ml.p3.16xlarge", "ml.p3dn.24xlarge", "ml.p4dn.24xlarge"]
FSDP_SHARDING_STRATEGY = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]
FSDP_AUTO_WRAP_POLICY = ["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"]
FSDP_BACKWARD_PREFETCH = ["BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"]
FSDP_STATE_DICT_TYPE = ["FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT"]
FSDP2_STATE_DICT_TYPE = ["SHARDED_STATE_DICT", "FULL_STATE_DICT"]
FSDP_PYTORCH_VERSION = "2.1.0.a0+32f93b1"  # Accelerate's value (MS-AMP's prerelease of 2.1.0)
FSDP2_PYTORCH_VERSION = "2.6.0"
DTENSOR_PYTORCH_VERSION = "2.5.0"
FSDP_MODEL_NAME = "pytorch_model_fsdp"
DEEPSPEED_MULTINODE_LAUNCHERS = ["pdsh", "standard", "openmpi", "mvapich", "mpich", "nossh", "slurm"]
TORCH_DYNAMO_MODES = ["default", "reduce-overhead", "max-autotune"]
ELASTIC_LOG_LINE_PREFIX_TEMPLATE_PYTORCH_VERSION = "2.2.0"
BETA_TP_AVAILABLE_PYTORCH_VERSION = "2.3.0"
BETA_TP_AVAILABLE_TRANSFORMERS_VERSION = "4.52.0"
BETA_CP_AVAILABLE_PYTORCH_VERSION = "2.6.0"
BETA_SP_AVAILABLE_DEEPSPEED_VERSION = "0.18.2"
STR_OPERATION_TO_FUNC = {">": operator.gt, ">=": operator.ge, "==": operator.eq, "!=": operator.ne,
                         "<=": operator.le, "<": operator.lt}
CUDA_DISTRIBUTED_TYPES = ["DEEPSPEED", "MULTI_GPU", "FSDP", "MEGATRON_LM", "TP"]


def __getattr__(name: str) -> Any:
    # The one constant made of torch classes: built on first use, so reading a file name here never imports torch.
    if name == "SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING":
        from torch import nn

        value = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
                 nn.Linear)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
