"""File names and tables that Accelerate exports from ``accelerate.utils`` (same values)."""

from __future__ import annotations

import enum

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
