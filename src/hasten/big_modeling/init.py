"""Build models without allocating their weights: ``init_empty_weights`` and ``init_on_device``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from hasten.base.environment import parse_flag_from_env

_INCLUDE_BUFFERS_VARIABLE = "ACCELERATE_INIT_INCLUDE_BUFFERS"


@contextmanager
def init_empty_weights(include_buffers: bool | None = None) -> Iterator[None]:
    """Create every parameter built inside the block on the ``meta`` device (no memory is allocated).

    Args:
        include_buffers: also put buffers on ``meta``; defaults to the ``ACCELERATE_INIT_INCLUDE_BUFFERS`` flag
            (False when unset), as in Accelerate.

    Example:
        >>> with init_empty_weights():
        ...     model = nn.Sequential(*[nn.Linear(10_000, 10_000) for _ in range(1000)])
        >>> model[0].weight.device.type
        'meta'
    """
    if include_buffers is None:
        include_buffers = parse_flag_from_env(_INCLUDE_BUFFERS_VARIABLE, False)
    with init_on_device(torch.device("meta"), include_buffers=include_buffers) as f:
        yield f


@contextmanager
def init_on_device(device: torch.device | str, include_buffers: bool | None = None) -> Iterator[None]:
    """Create every parameter (and buffer if ``include_buffers``) built inside the block on ``device``.

    Parameters keep their class, ``requires_grad`` and extra attributes. With ``include_buffers`` the
    torch device context manager is used, so every tensor factory inside the block targets ``device``.

    Example:
        >>> with init_on_device("meta"):
        ...     layer = nn.Linear(4, 4)
    """
    if include_buffers is None:
        include_buffers = parse_flag_from_env(_INCLUDE_BUFFERS_VARIABLE, False)
    device = torch.device(device)
    if include_buffers:
        with device:
            yield
        return
    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is None or param.device == device:
            return  # already there: keep the object, so ties made inside the block (a.weight = b.weight) hold
        registered: Any = module._parameters[name]
        param_cls = type(registered)
        extras: dict[str, Any] = dict(registered.__dict__)
        hf_initialized = extras.pop("_is_hf_initialized", None)  # transformers' marker is not a ctor kwarg
        moved = registered.to(device)
        try:
            new_param = param_cls(moved, **extras)
        except TypeError:  # plain nn.Parameter (or a subclass) takes no extra kwargs
            new_param = param_cls(moved, requires_grad=param.requires_grad)
        new_param.requires_grad_(param.requires_grad)
        if hf_initialized is not None:
            new_param._is_hf_initialized = hf_initialized
        module._parameters[name] = new_param

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]
