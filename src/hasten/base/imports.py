"""Accelerate's ``is_*_available`` checks: is a package importable, is a device present.

Each check looks the package up with ``importlib.util.find_spec`` (never importing it) and caches the
answer, so calling one per step costs a dictionary lookup. Device checks ask torch, which is imported
anyway. Accelerators hasten has no engine for (NPU, MLU, MUSA, SDAA, HPU, Neuron, XLA) are still
answered truthfully: a script that branches on them keeps working on the hardware hasten does run.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import operator
import socket
import sys
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
from packaging.version import Version

from hasten._lazy import accelerate_path_getattr

if TYPE_CHECKING:
    from torch._dynamo.eval_frame import OptimizedModule

_OPERATIONS = {"<": operator.lt, "<=": operator.le, "==": operator.eq, "!=": operator.ne, ">=": operator.ge,
               ">": operator.gt}


@functools.cache
def _installed(module: str, min_version: str | None = None, distribution: str | None = None) -> bool:
    try:
        if importlib.util.find_spec(module) is None:
            return False
    except (ImportError, ValueError):  # a parent package missing, or a broken __spec__
        return False
    if min_version is None:
        return True
    try:
        return Version(importlib.metadata.version(distribution or module)) >= Version(min_version)
    except importlib.metadata.PackageNotFoundError:
        return False


def compare_versions(library_or_version, operation: str, requirement_version: str) -> bool:
    """Compare a library's installed version (or a version string) with a requirement.

    Example: ``compare_versions("torch", ">=", "2.2")``.
    """
    if operation not in _OPERATIONS:
        raise ValueError(f"compare_versions: operation {operation!r} is not one of {sorted(_OPERATIONS)}")
    if isinstance(library_or_version, str) and not library_or_version[:1].isdigit():
        library_or_version = Version(importlib.metadata.version(library_or_version))
    elif isinstance(library_or_version, str):
        library_or_version = Version(library_or_version)
    return _OPERATIONS[operation](library_or_version, Version(requirement_version))


def is_torch_version(operation: str, version: str) -> bool:
    """Compare the installed torch's version: ``is_torch_version(">=", "2.4")``."""
    return compare_versions(Version(Version(torch.__version__).base_version), operation, version)


# ---- packages -------------------------------------------------------------------------------------------
def is_aim_available() -> bool:
    """Whether the ``aim`` tracker package is importable."""
    return _installed("aim")


def is_bnb_available(min_version: str | None = None) -> bool:
    """Whether ``bitsandbytes`` is importable (at ``min_version`` or newer when given)."""
    return _installed("bitsandbytes", min_version)


def is_4bit_bnb_available() -> bool:
    """Whether bitsandbytes can quantize to 4 bits (0.39 or newer)."""
    return _installed("bitsandbytes", "0.39.0")


def is_8bit_bnb_available() -> bool:
    """Whether bitsandbytes can quantize to 8 bits (0.37.2 or newer)."""
    return _installed("bitsandbytes", "0.37.2")


def is_bitsandbytes_multi_backend_available() -> bool:
    """Whether bitsandbytes has its multi-backend (non-CUDA) build."""
    if not _installed("bitsandbytes"):
        return False
    import bitsandbytes

    return "multi_backend" in getattr(bitsandbytes, "features", set())


def is_amdsmi_available() -> bool:
    """Whether the ``amdsmi`` package is importable."""
    return _installed("amdsmi")


def is_boto3_available() -> bool:
    """Whether ``boto3`` is importable."""
    return _installed("boto3")


def is_clearml_available() -> bool:
    """Whether the ``clearml`` tracker package is importable."""
    return _installed("clearml")


def is_comet_ml_available() -> bool:
    """Whether the ``comet_ml`` tracker package is importable."""
    return _installed("comet_ml")


def is_datasets_available() -> bool:
    """Whether 🤗 ``datasets`` is importable."""
    return _installed("datasets")


def is_deepspeed_available() -> bool:
    """Whether ``deepspeed`` is importable."""
    return _installed("deepspeed")


def is_dvclive_available() -> bool:
    """Whether the ``dvclive`` tracker package is importable."""
    return _installed("dvclive")


def is_import_timer_available() -> bool:
    """Whether ``import_timer`` is importable."""
    return _installed("import_timer")


def is_lomo_available() -> bool:
    """Whether ``lomo_optim`` is importable."""
    return _installed("lomo_optim")


def is_matplotlib_available() -> bool:
    """Whether ``matplotlib`` is importable."""
    return _installed("matplotlib")


def is_megatron_lm_available() -> bool:
    """Whether Megatron-LM is importable (hasten has no Megatron-LM engine; see ``MegatronLMPlugin``)."""
    return _installed("megatron")


def is_mlflow_available() -> bool:
    """Whether ``mlflow`` is importable."""
    return _installed("mlflow")


def is_msamp_available() -> bool:
    """Whether MS-AMP is importable."""
    return _installed("msamp")


def is_pandas_available() -> bool:
    """Whether ``pandas`` is importable."""
    return _installed("pandas")


def is_peft_available() -> bool:
    """Whether ``peft`` is importable."""
    return _installed("peft")


def is_pippy_available() -> bool:
    """Whether torch's pipelining (``torch.distributed.pipelining``) is there."""
    return _installed("torch.distributed.pipelining")


def is_pynvml_available() -> bool:
    """Whether ``pynvml`` is importable."""
    return _installed("pynvml")


def is_pytest_available() -> bool:
    """Whether ``pytest`` is importable."""
    return _installed("pytest")


def is_rich_available() -> bool:
    """Whether ``rich`` is importable."""
    return _installed("rich")


def is_sagemaker_available() -> bool:
    """Whether the ``sagemaker`` SDK is importable (hasten does not launch on SageMaker)."""
    return _installed("sagemaker")


def is_schedulefree_available() -> bool:
    """Whether ``schedulefree`` is importable."""
    return _installed("schedulefree")


def is_swanlab_available() -> bool:
    """Whether the ``swanlab`` tracker package is importable."""
    return _installed("swanlab")


def is_tensorboard_available() -> bool:
    """Whether TensorBoard's writer is importable (``tensorboard`` or ``tensorboardX``)."""
    return _installed("tensorboard") or _installed("tensorboardX")


def is_timm_available() -> bool:
    """Whether ``timm`` is importable."""
    return _installed("timm")


def is_torchao_available() -> bool:
    """Whether ``torchao`` is importable."""
    return _installed("torchao")


def is_torchdata_available() -> bool:
    """Whether ``torchdata`` is importable."""
    return _installed("torchdata")


def is_torchdata_stateful_dataloader_available() -> bool:
    """Whether torchdata's ``StatefulDataLoader`` is there."""
    return _installed("torchdata.stateful_dataloader")


def is_torchvision_available() -> bool:
    """Whether ``torchvision`` is importable."""
    return _installed("torchvision")


def is_trackio_available() -> bool:
    """Whether the ``trackio`` tracker package is importable."""
    return _installed("trackio")


def is_transformer_engine_available() -> bool:
    """Whether NVIDIA Transformer Engine is importable."""
    return _installed("transformer_engine")


def is_transformer_engine_mxfp8_available() -> bool:
    """Whether Transformer Engine is importable on a GPU with MXFP8 (compute capability 10 or newer)."""
    return is_transformer_engine_available() and torch.cuda.is_available() and \
        torch.cuda.get_device_capability()[0] >= 10


def is_transformers_available() -> bool:
    """Whether 🤗 ``transformers`` is importable."""
    return _installed("transformers")


def is_triton_available() -> bool:
    """Whether ``triton`` is importable."""
    return _installed("triton")


def is_wandb_available() -> bool:
    """Whether ``wandb`` is importable."""
    return _installed("wandb")


def is_weights_only_available() -> bool:
    """Whether ``torch.load(weights_only=True)`` is there (torch 2.4 and newer)."""
    return is_torch_version(">=", "2.4.0")


# ---- devices --------------------------------------------------------------------------------------------
@functools.cache
def is_cuda_available() -> bool:
    """Whether a CUDA (or ROCm) GPU is usable, asked without initialising CUDA when possible."""
    return torch.cuda.is_available()


@functools.cache
def is_rocm_available() -> bool:
    """Whether torch is a ROCm build with a GPU present."""
    return torch.version.hip is not None and torch.cuda.is_available()


def is_mps_available(min_version: str = "1.12") -> bool:
    """Whether Apple's MPS backend is there and usable."""
    return is_torch_version(">=", min_version) and torch.backends.mps.is_available() and \
        torch.backends.mps.is_built()


@functools.cache
def is_xpu_available(check_device: bool = False) -> bool:
    """Whether torch has Intel XPU support (and, with ``check_device``, a device is present)."""
    xpu = getattr(torch, "xpu", None)
    if xpu is None or not xpu.is_available():
        return False
    return not check_device or xpu.device_count() > 0


def is_xccl_available() -> bool:
    """Whether torch.distributed has the XCCL backend (Intel GPUs)."""
    return bool(torch.distributed.is_available() and getattr(torch.distributed, "is_xccl_available",
                                                             lambda: False)())


def _vendor_device(module: str, attribute: str, check_device: bool) -> bool:
    if not _installed(module):
        return False
    if not check_device:
        return True
    backend = getattr(torch, attribute, None)
    try:
        return backend is not None and backend.device_count() > 0
    except RuntimeError:
        return False


@functools.cache
def is_npu_available(check_device: bool = False) -> bool:
    """Whether Ascend NPU support (``torch_npu``) is installed (and, with ``check_device``, a device is present)."""
    return _vendor_device("torch_npu", "npu", check_device)


@functools.cache
def is_mlu_available(check_device: bool = False) -> bool:
    """Whether Cambricon MLU support (``torch_mlu``) is installed."""
    return _vendor_device("torch_mlu", "mlu", check_device)


@functools.cache
def is_musa_available(check_device: bool = False) -> bool:
    """Whether Moore Threads MUSA support (``torch_musa``) is installed."""
    return _vendor_device("torch_musa", "musa", check_device)


@functools.cache
def is_sdaa_available(check_device: bool = False) -> bool:
    """Whether Tecorigin SDAA support (``torch_sdaa``) is installed."""
    return _vendor_device("torch_sdaa", "sdaa", check_device)


@functools.cache
def is_neuron_available(check_device: bool = False) -> bool:
    """Whether AWS Neuron support (``torch_neuronx``) is installed."""
    return _vendor_device("torch_neuronx", "neuron", check_device)


@functools.cache
def is_hpu_available(init_hccl: bool = False) -> bool:
    """Whether Intel Gaudi support (``habana_frameworks``) is installed."""
    return _installed("habana_frameworks")


def is_habana_gaudi1() -> bool:
    """Whether the HPU present is a first-generation Gaudi (never true without Gaudi support)."""
    if not is_hpu_available():
        return False
    import habana_frameworks.torch.utils.experimental as htexp  # type: ignore[import-not-found]

    return htexp._get_device_type() == htexp.synDeviceType.synDeviceGaudi


@functools.cache
def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    """Whether ``torch_xla`` is installed (hasten has no XLA engine; TPUs are refused at use)."""
    return _installed("torch_xla")


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """Whether bf16 compute is available: on CPU always, on CUDA when the GPU supports it."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    return True


def is_fp16_available() -> bool:
    """Whether fp16 mixed precision is available (hasten runs fp16 autocast on CPU and CUDA)."""
    return True


def is_fp8_available() -> bool:
    """Whether an fp8 engine is usable: torchao, Transformer Engine or MS-AMP with an fp8-capable GPU."""
    engines = _installed("torchao") or _installed("transformer_engine") or _installed("msamp")
    return engines and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


# ---- objects --------------------------------------------------------------------------------------------
def is_compiled_module(module: Any) -> TypeGuard[OptimizedModule]:
    """Whether ``module`` was wrapped by ``torch.compile``.

    No compiled module exists before ``torch._dynamo`` is imported, so the answer is no without importing
    it: that import alone costs about 2 CPU-seconds, in every process that asks.
    """
    if "torch._dynamo.eval_frame" not in sys.modules:
        return False
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(module, OptimizedModule)


def is_peft_model(model) -> bool:
    """Whether ``model`` is a PEFT model (without importing peft when it is not installed)."""
    if not is_peft_available():
        return False
    if "peft" not in sys.modules:  # no PeftModel exists before peft is imported (which imports transformers)
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


def is_port_in_use(port: int | None = None) -> bool:
    """Whether something listens on ``localhost:port`` (default: 29500, torchrun's port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex(("localhost", port or 29500)) == 0


def get_free_port() -> int:
    """A TCP port on this machine that nothing listens on now (the system picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


# Names Accelerate shows at this module path but hasten defines elsewhere (hasten/_accelerate_paths.py).
__getattr__ = accelerate_path_getattr(__name__, globals())


def is_numpy_available(min_version: str = "1.25.0") -> bool:
    """Whether numpy is installed at ``min_version`` or newer."""
    return _installed("numpy", min_version)


def is_tqdm_available() -> bool:
    """Whether ``tqdm`` is importable."""
    return _installed("tqdm")


def is_torch_distributed_available() -> bool:
    """Whether this torch build has ``torch.distributed``."""
    return bool(torch.distributed.is_available())
