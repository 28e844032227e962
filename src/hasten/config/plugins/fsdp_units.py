"""Which sub-modules become their own FSDP2 unit: transformer-class, size-based and callable policies.

A unit is a module passed to ``fully_shard`` before the root; its parameters are gathered and freed
together, so the peak memory is one unit's full parameters rather than the whole model's. These are
pure ``nn.Module`` walkers (no ``torch.distributed``), so they live beside the plugin that names the
policy: the plugin (``set_auto_wrap_policy``) and the FSDP2 strategy both import them from here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from hasten.exceptions import ConfigurationError

if TYPE_CHECKING:
    from torch import nn

#: ``size_based_wrap``'s threshold when the plugin sets no ``min_num_params`` (Accelerate's default).
DEFAULT_MIN_NUM_PARAMS = 100_000_000

#: ``policy(module, unwrapped_numel) -> bool``; ``unwrapped_numel`` counts parameters not already in a chosen unit.
UnitPolicy = Callable[["nn.Module", int], bool]


def _transformer_policy(names: list[str], model: nn.Module) -> UnitPolicy:
    present = {type(m).__name__ for m in model.modules()}
    missing = [n for n in names if n not in present]
    if missing:
        raise ConfigurationError(
            f"Could not find the transformer layer class {missing[0]} in the model. "  # Accelerate's words first
            f"transformer_cls_names_to_wrap={names}: no module of class {missing} in {type(model).__name__}. "
            f"Classes in the model: {sorted(present)[:30]}. Name the repeated block class (e.g. the decoder layer).")
    wanted = set(names)
    return lambda module, numel: type(module).__name__ in wanted


def _size_policy(min_num_params: int) -> UnitPolicy:
    # Counting only parameters outside already chosen descendants (as FSDP1's size policy does) avoids
    # wrapping a parent whose own remaining parameters are tiny just because its children are big.
    return lambda module, numel: numel >= min_num_params


def build_wrap_policy(plugin: Any, model: nn.Module) -> UnitPolicy | None:
    """The unit policy for ``plugin.auto_wrap_policy`` (None: the root is the only unit).

    Example:
        >>> policy = build_wrap_policy(FullyShardedDataParallelPlugin(min_num_params=10), model)
    """
    policy = plugin.auto_wrap_policy
    if policy is None or policy == "no_wrap":
        return None
    if policy == "transformer_based_wrap":
        names = plugin.transformer_cls_names_to_wrap or list(getattr(model, "_no_split_modules", None) or [])
        if not names:
            raise ConfigurationError(
                "auto_wrap_policy='transformer_based_wrap' needs transformer_cls_names_to_wrap (the block class "
                f"names, e.g. ['DecoderLayer']); {type(model).__name__} has no `_no_split_modules` to default to.")
        return _transformer_policy(list(names), model)
    if policy == "size_based_wrap":
        threshold = plugin.min_num_params if plugin.min_num_params is not None else DEFAULT_MIN_NUM_PARAMS
        return _size_policy(int(threshold))
    if callable(policy):
        return lambda module, numel: bool(policy(module))
    raise ConfigurationError(f"auto_wrap_policy={policy!r} is not a policy name or a callable.")


def select_units(model: nn.Module, policy: UnitPolicy | None, ignored: Iterable[nn.Module] = ()) -> list[nn.Module]:
    """Modules to ``fully_shard`` before the root, deepest first (children before parents).

    Ignored modules and everything inside them are never units.
    """
    if policy is None:
        return []
    skip = {id(m) for m in ignored}
    seen: set[int] = set()
    chosen: list[nn.Module] = []

    def visit(module: nn.Module) -> int:
        if id(module) in skip or id(module) in seen:
            return 0
        seen.add(id(module))
        numel = sum(p.numel() for p in module.parameters(recurse=False))
        for child in module.children():
            numel += visit(child)
        if module is not model and numel > 0 and policy(module, numel):
            chosen.append(module)
            return 0
        return numel

    visit(model)
    return chosen


def checkpoint_targets(model: nn.Module, units: list[nn.Module], ignored: Iterable[nn.Module] = ()) -> list[nn.Module]:
    """Modules whose activations are recomputed: the outermost units, else the root's children with parameters."""
    if units:
        nested = {id(m) for unit in units for m in unit.modules() if m is not unit}
        return [unit for unit in units if id(unit) not in nested]
    skip = {id(m) for m in ignored}
    return [child for child in model.children()
            if id(child) not in skip and any(True for _ in child.parameters())]


def ignored_module_list(model: nn.Module, ignored: Any) -> list[nn.Module]:
    """Resolve ``ignored_modules`` (modules, or a regex matched against module names) for ``model``."""
    if ignored is None:
        return []
    if isinstance(ignored, str):
        pattern = re.compile(ignored)
        return [module for name, module in model.named_modules() if name and pattern.fullmatch(name)]
    if isinstance(ignored, Iterable):
        return list(ignored)
    raise ConfigurationError(f"ignored_modules={ignored!r} must be a list of modules or a regex of module names.")


__all__ = ["DEFAULT_MIN_NUM_PARAMS", "UnitPolicy", "build_wrap_policy", "checkpoint_targets", "ignored_module_list",
           "select_units"]
