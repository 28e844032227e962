"""fp8 training: torchao's float8 linear layers under bf16 autocast (Accelerate's ``AO`` backend).

The decision (which engine, whether this hardware can run it) is pure and takes the device's facts
as arguments, so it is tested on any machine; the device query itself lives in ``hasten.devices``.
torchao is imported only when a model is converted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from hasten.base.dataclasses import AutocastKwargs
from hasten.base.fp8 import (
    AORecipeKwargs,
    FP8RecipeKwargs,
    MSAMPRecipeKwargs,
    TERecipeKwargs,
    ao_float8_config,
    convert_model_to_fp8_ao,
)
from hasten.exceptions import ConfigurationError, MissingDependencyError
from hasten.precision.amp import BF16Precision

# float8 tensor-core matmuls (torch._scaled_mm on CUDA) exist from Ada Lovelace (8.9) and Hopper (9.0) on.
FP8_MIN_CAPABILITY = (8, 9)
_BACKENDS = ("AO", "TE", "MSAMP")
_NAMES = {"AO": "torchao", "TE": "Transformer Engine", "MSAMP": "MS-AMP"}
_ALTERNATIVE = "HINT: use mixed_precision='bf16' (or 'fp16') here."


def fp8_backend(handlers: Mapping[type, Any], launch_fp8_config: Mapping[str, Any] | None = None) -> str:
    """The fp8 engine a run asks for: ``"AO"``, ``"TE"`` or ``"MSAMP"``.

    A recipe in ``kwargs_handlers`` wins (``FP8RecipeKwargs`` means Transformer Engine unless its
    ``backend`` says MSAMP, as in Accelerate), then the launch configuration's ``fp8_config.backend``,
    then torchao.

    Raises:
        ConfigurationError: an unknown backend name in the launch configuration.
    """
    if TERecipeKwargs in handlers:
        return "TE"
    if MSAMPRecipeKwargs in handlers:
        return "MSAMP"
    if FP8RecipeKwargs in handlers:
        return str(handlers[FP8RecipeKwargs].backend or "TE")
    if AORecipeKwargs in handlers:
        return "AO"
    backend = str((launch_fp8_config or {}).get("backend") or "AO").upper()
    if backend not in _BACKENDS:
        raise ConfigurationError(f"fp8_config backend {backend!r} is not one of {list(_BACKENDS)} (AO is torchao).")
    return backend


def check_fp8_support(backend: str, *, on_cpu: bool, capability: tuple[int, int] | None, device_label: str,
                      torchao_available: bool, backend_package_available: bool = False) -> None:
    """Refuse fp8 where it cannot run, naming what is missing and the alternative.

    Args:
        backend: from :func:`fp8_backend`.
        on_cpu: the run computes on the CPU (``cpu=True``, ``--cpu``, or no GPU).
        capability: the GPU's compute capability, None without a CUDA GPU.
        device_label: the device's name, for the message.
        torchao_available: whether ``torchao`` is importable.
        backend_package_available: for TE/MSAMP, whether that package is importable.

    Raises:
        ConfigurationError: the requested fp8 engine cannot run here.
    """
    if on_cpu or capability is None:
        found = "no CUDA GPU (the run is on the CPU)"
    elif capability < FP8_MIN_CAPABILITY:
        found = f"a GPU of compute capability {capability[0]}.{capability[1]} ({device_label})"
    else:
        found = ""
    if backend in ("TE", "MSAMP"):
        package = "transformer_engine" if backend == "TE" else "msamp"
        have = f"{package} is {'installed' if backend_package_available else 'not installed'}"
        raise ConfigurationError(
            f"fp8 through {_NAMES[backend]} ({backend}) is not available in hasten ({have}; this machine has "
            f"{found or device_label}): hasten's fp8 engine is torchao. Use AORecipeKwargs() (or fp8_config "
            f"backend: AO) on an NVIDIA GPU of compute capability 8.9 or newer with torchao. {_ALTERNATIVE}")
    if found:
        raise ConfigurationError(
            f"mixed_precision='fp8' needs an NVIDIA GPU of compute capability 8.9 or newer (Ada or Hopper: L4, "
            f"RTX 4090, H100...) and torchao, whose float8 training hasten uses; this machine has {found}. "
            f"{_ALTERNATIVE}")
    if not torchao_available:
        raise ConfigurationError(
            "mixed_precision='fp8' needs torchao, whose float8 training hasten uses, and it is not installed: "
            f"`pip install torchao` (or `pip install 'hasten[fp8]'`). {_ALTERNATIVE}")


def ao_recipe_from_launch(fp8_config: Mapping[str, Any] | None) -> AORecipeKwargs:
    """The torchao recipe an ``fp8_config`` block of a launch/config file asks for (its AO switches)."""
    config = fp8_config or {}
    return AORecipeKwargs(pad_inner_dim=config.get("pad_inner_dim"),
                          enable_fsdp_float8_all_gather=config.get("enable_fsdp_float8_all_gather"))


class FP8Precision(BF16Precision):
    """fp8 training: the model's linear layers become torchao ``Float8Linear`` (float8 matmuls with
    dynamic scaling), everything else runs under bf16 autocast, as Accelerate's AO backend does.

    Args:
        device_type: torch's device type.
        autocast_handler: autocast settings for the bf16 part.
        recipe: the ``AORecipeKwargs`` (torchao config, module filter); None for the defaults.
    """

    mixed_precision = "fp8"

    def __init__(self, device_type: str = "cuda", autocast_handler: AutocastKwargs | None = None,
                 recipe: AORecipeKwargs | None = None) -> None:
        super().__init__(device_type, autocast_handler)
        self.recipe = recipe

    def convert_module(self, model: nn.Module) -> None:
        """Swap the selected linear layers of ``model`` for float8 ones, in place (once)."""
        from hasten.base.modeling import has_ao_layers

        if has_ao_layers(model):
            return
        try:
            config = ao_float8_config(self.recipe)
        except ImportError as exc:
            raise MissingDependencyError("torchao", "fp8 training (mixed_precision='fp8')") from exc
        convert_model_to_fp8_ao(model, config, self.recipe.module_filter_func if self.recipe else None)


__all__ = ["FP8_MIN_CAPABILITY", "FP8Precision", "ao_recipe_from_launch", "check_fp8_support", "fp8_backend"]
