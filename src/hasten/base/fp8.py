"""fp8 recipe settings (Accelerate's ``AORecipeKwargs``, ``TERecipeKwargs``, ``MSAMPRecipeKwargs``,
``FP8RecipeKwargs``).

hasten's fp8 engine is torchao's float8 training, which needs a GPU of compute capability 8.9 or
newer; the Accelerator refuses ``mixed_precision="fp8"`` elsewhere, naming that requirement. The
Transformer Engine and MS-AMP recipes are accepted as settings (configs load) but refused when used.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hasten.base.dataclasses import KwargsHandler
from hasten.exceptions import ConfigurationError

_FORMATS = ("HYBRID", "E4M3", "E5M2")


@dataclass
class AORecipeKwargs(KwargsHandler):
    """torchao float8 training settings.

    Args:
        config: a ``torchao.float8.Float8LinearConfig`` (default: torchao's default recipe).
        module_filter_func: ``(module, fqn) -> bool``, which linear layers to convert.
        pad_inner_dim: pad inner dimensions to multiples of 16 (instead of skipping such layers).
        enable_fsdp_float8_all_gather: all-gather FSDP2 shards in fp8.
    """

    config: Any = None
    module_filter_func: Callable[..., bool] | None = None
    pad_inner_dim: bool | None = None
    enable_fsdp_float8_all_gather: bool | None = None


@dataclass
class TERecipeKwargs(KwargsHandler):
    """Transformer Engine fp8 recipe (accepted for config compatibility; hasten runs fp8 through torchao).

    ``amax_history_length`` is accepted as another spelling of ``amax_history_len`` in config files.
    """

    use_autocast_during_eval: bool | None = None
    margin: int | None = None
    interval: int | None = None
    fp8_format: str | None = None
    amax_history_len: int | None = None
    amax_compute_algo: str | None = None
    override_linear_precision: tuple[bool, bool, bool] | None = None
    use_mxfp8_block_scaling: bool | None = None

    def __post_init__(self) -> None:
        if self.fp8_format is not None:
            self.fp8_format = str(self.fp8_format).upper()
            if self.fp8_format not in _FORMATS:
                raise ConfigurationError(f"fp8_format={self.fp8_format!r} is not one of {list(_FORMATS)}")
        if self.amax_compute_algo is not None and self.amax_compute_algo not in ("max", "most_recent"):
            raise ConfigurationError(f"amax_compute_algo={self.amax_compute_algo!r} is not 'max' or 'most_recent'")


@dataclass
class MSAMPRecipeKwargs(KwargsHandler):
    """MS-AMP fp8 recipe (accepted for config compatibility; refused when training: use torchao)."""

    opt_level: str | None = None

    def __post_init__(self) -> None:
        if self.opt_level is not None and self.opt_level not in ("O1", "O2"):
            raise ConfigurationError(f"opt_level={self.opt_level!r} is not 'O1' or 'O2'")


@dataclass
class FP8RecipeKwargs(TERecipeKwargs):
    """Accelerate's older, combined fp8 recipe: ``backend="TE"`` or ``"MSAMP"`` plus that backend's fields."""

    opt_level: str | None = None
    backend: str | None = None

    def __init__(self, opt_level: str | None = None, use_autocast_during_eval: bool | None = None,
                 margin: int | None = None, interval: int | None = None, fp8_format: str | None = None,
                 amax_history_len: int | None = None, amax_compute_algo: str | None = None,
                 override_linear_precision: tuple[bool, bool, bool] | None = None,
                 use_mxfp8_block_scaling: bool | None = None, backend: str | None = None) -> None:
        self.opt_level = opt_level
        self.use_autocast_during_eval = use_autocast_during_eval
        self.margin = margin
        self.interval = interval
        self.fp8_format = fp8_format
        self.amax_history_len = amax_history_len
        self.amax_compute_algo = amax_compute_algo
        self.override_linear_precision = override_linear_precision
        self.use_mxfp8_block_scaling = use_mxfp8_block_scaling
        self.backend = backend.upper() if isinstance(backend, str) else backend
        if self.backend not in (None, "TE", "MSAMP"):
            raise ConfigurationError(f"FP8RecipeKwargs(backend={backend!r}): use 'TE' or 'MSAMP' (or AORecipeKwargs "
                                     "for torchao)")
        self.__post_init__()


class FP8BackendType(str, enum.Enum):
    """The fp8 engines Accelerate names (hasten runs ``AO``, torchao)."""

    NO = "NO"
    TE = "TE"
    MSAMP = "MSAMP"
    AO = "AO"


def find_first_last_linear_layers(model: Any) -> tuple[str | None, str | None]:
    """The qualified names of ``model``'s first and last ``nn.Linear`` layers (None when it has none).

    fp8 training keeps these two in high precision: the embedding-side and output-side projections
    are the ones whose float8 rounding most often stops a model from converging.
    """
    import torch

    first: str | None = None
    last: str | None = None
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            first = name if first is None else first
            last = name
    return first, last


def filter_linear_layers(module: Any, fqn: str, layers_to_filter: list[str]) -> bool:
    """Accelerate's float8 filter: False for a linear layer whose dimensions are not both multiples of 16
    (float8 matmul kernels need that) and for a layer named in ``layers_to_filter``; True otherwise.

    Example:
        >>> filter_linear_layers(torch.nn.Linear(32, 32), "head", ["head"])
        False
    """
    import torch

    if isinstance(module, torch.nn.Linear) and not filter_first_and_last_linear_layers(module, fqn):
        return False  # the float8 shape rule, kept in one place
    return fqn not in layers_to_filter


def filter_first_and_last_linear_layers(module: Any, fqn: str) -> bool:
    """A ``module_filter_func`` that only checks the float8 shape rule: ``module`` is an ``nn.Linear``
    whose dimensions are both multiples of 16. :func:`convert_model_to_fp8_ao` also skips the model's
    first and last linear layers (it knows the model; this function sees one layer)."""
    import torch

    if not isinstance(module, torch.nn.Linear):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def ao_float8_config(recipe: AORecipeKwargs | None) -> Any:
    """torchao's ``Float8LinearConfig`` for ``recipe``: its own ``config``, else torchao's default with the
    recipe's ``pad_inner_dim`` / ``enable_fsdp_float8_all_gather`` switches (imports torchao)."""
    from torchao.float8 import Float8LinearConfig

    if recipe is not None and recipe.config is not None:
        return recipe.config
    options = {}
    if recipe is not None and recipe.pad_inner_dim is not None:
        options["pad_inner_dim"] = bool(recipe.pad_inner_dim)
    if recipe is not None and recipe.enable_fsdp_float8_all_gather is not None:
        options["enable_fsdp_float8_all_gather"] = bool(recipe.enable_fsdp_float8_all_gather)
    return Float8LinearConfig(**options)


def convert_model_to_fp8_ao(model: Any, config: Any = None, module_filter_func: Callable[..., bool] | None = None) -> None:
    """Swap ``model``'s linear layers for torchao's float8 training layers, in place.

    Args:
        model: the module to convert.
        config: a ``torchao.float8.Float8LinearConfig`` (torchao's default when None).
        module_filter_func: ``(module, fqn) -> bool``; default: every linear layer but the first and
            last whose dimensions are multiples of 16 (:func:`filter_linear_layers`).

    Raises:
        MissingDependencyError: torchao is not installed.
    """
    from hasten.base.imports import is_torchao_available
    from hasten.exceptions import MissingDependencyError

    if not is_torchao_available():
        raise MissingDependencyError("torchao", "fp8 training (`convert_model_to_fp8_ao`)")
    from torchao.float8 import convert_to_float8_training

    if module_filter_func is None:
        first, last = find_first_last_linear_layers(model)
        module_filter_func = functools.partial(filter_linear_layers, layers_to_filter=[n for n in (first, last) if n])
    convert_to_float8_training(model, config=config if config is not None else ao_float8_config(None),
                               module_filter_fn=module_filter_func)

