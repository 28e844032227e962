"""Accelerate names that belong to hardware or products hasten has no engine for.

They exist at Accelerate's import paths with Accelerate's parameter names, so that a script imports
cleanly and its other code paths run; *using* one raises a ``ConfigurationError`` that names the
product and what to use instead. Nothing here raises at import.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from hasten.exceptions import ConfigurationError

MEGATRON = ("Megatron-LM", "train large models with FSDP2 "
            "(`FullyShardedDataParallelPlugin`) or DeepSpeed (`DeepSpeedPlugin`)")
TPU = ("TPUs / torch_xla", "hasten runs on CPUs and CUDA GPUs; on TPUs use Accelerate or torch_xla directly")
SAGEMAKER = ("Amazon SageMaker launching", "start the job with SageMaker's own PyTorch estimator and "
             "`hasten launch` (or torchrun) inside it")
BNB = ("bitsandbytes quantization", "quantize with transformers' `BitsAndBytesConfig` "
       "(`from_pretrained(..., quantization_config=...)`) and prepare the quantized model as usual")
TRANSFORMER_ENGINE = ("NVIDIA Transformer Engine / MS-AMP fp8", "hasten's fp8 path is torchao "
                      "(`AORecipeKwargs`), on GPUs with compute capability 8.9 or newer")
ND_PARALLEL = ("DeepSpeed-Ulysses sequence parallelism", "split long sequences with "
               "`ParallelismConfig(cp_size=...)` (CUDA), and tensor-parallelize with `ParallelismConfig(tp_size=..., "
               "tp_handler=TorchTensorParallelConfig(...))` (docs: N-D parallelism)")
LOMO = ("LOMO optimizers", "use a regular torch optimizer (fused AdamW) or DeepSpeed's ZeRO offload")
ACCELERATE_LAUNCHER = ("Accelerate's launcher internals", "start processes with `hasten launch` (or "
                       "`hasten.launchers.notebook_launcher` in Python)")


def refusal(name: str, product: tuple[str, str]) -> ConfigurationError:
    """The error a refused name raises: what it belongs to, and what to use instead."""
    what, instead = product
    return ConfigurationError(f"`{name}` belongs to {what}, which hasten does not support; {instead}.")


def _signature(params: str, method: bool) -> inspect.Signature:
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)] if method else []
    for name in params.split():
        if name == "*args":
            parameters.append(inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL))
        elif name == "**kwargs":
            parameters.append(inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD))
        else:
            parameters.append(inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None))
    return inspect.Signature(parameters)


def refused_function(name: str, params: str, product: tuple[str, str]) -> Callable[..., Any]:
    """A function ``name(params...)`` that raises the refusal when called."""

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise refusal(name, product)

    refused.__name__ = refused.__qualname__ = name
    refused.__doc__ = f"Not supported by hasten ({product[0]}): {product[1]}."
    refused.__signature__ = _signature(params, method=False)  # type: ignore[attr-defined]
    return refused


def refused_class(name: str, params: str, product: tuple[str, str], methods: str = "",
                  base: type = object) -> type:
    """A class ``name`` whose constructor (and listed methods) raise the refusal."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        raise refusal(name, product)

    __init__.__signature__ = _signature(params, method=True)  # type: ignore[attr-defined]
    namespace: dict[str, Any] = {"__init__": __init__, "__doc__": f"Not supported by hasten ({product[0]}): "
                                 f"{product[1]}.", "__module__": "hasten.utils"}
    for spec in methods.split(";"):
        if not spec.strip():
            continue
        method_name, _, method_params = spec.strip().partition(" ")
        kind = "method"
        if method_name.startswith("@"):
            kind, method_name = "staticmethod", method_name[1:]
        function = refused_function(f"{name}.{method_name}", method_params, product)
        if kind == "staticmethod":
            namespace[method_name] = staticmethod(function)
        else:
            function.__signature__ = _signature(method_params, method=True)  # type: ignore[attr-defined]
            namespace[method_name] = function
    return type(name, (base,), namespace)
