"""Accelerate's helpers that ask this process's state: who writes a shared file, is this run DeepSpeed,
which autocast applies.

Their names are Accelerate's (``hasten.utils.save``, ``hasten.utils.deepspeed_required``, ...; the
``hasten.utils`` facade re-exports them lazily); their code lives here, one floor above
:mod:`hasten.state`, so that nothing on the ground floor imports upward.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from typing import Any

import torch

from hasten.base.serialization import save_atomically
from hasten.checkpointing.custom import write_custom_state
from hasten.exceptions import ConfigurationError
from hasten.state import AcceleratorState, PartialState


def writes_shared_files(save_on_each_node: bool = False) -> bool:
    """Whether this process writes a file that all processes share: the main process, or each machine's
    first process with ``save_on_each_node`` (the one rule for ``save``, ``save_custom_state`` and
    ``Accelerator.save``).

    Example:
        >>> if writes_shared_files():
        ...     Path("summary.json").write_text("{}")
    """
    state = PartialState()
    return bool(state.is_local_main_process if save_on_each_node else state.is_main_process)


def save(obj: Any, f: str | os.PathLike[str], save_on_each_node: bool = False,
         safe_serialization: bool = False) -> None:
    """Save ``obj`` once per job (or once per machine with ``save_on_each_node``), crash-safely.

    Example:
        >>> save(accelerator.get_state_dict(model), "weights.safetensors", safe_serialization=True)
    """
    if writes_shared_files(save_on_each_node):
        save_atomically(obj, f, safe_serialization=safe_serialization)


def save_custom_state(obj: Any, path: str | os.PathLike[str], index: int = 0, save_on_each_node: bool = False) -> None:
    """Save ``obj.state_dict()`` to ``path/custom_checkpoint_{index}.pkl`` (on the main process, or once
    per machine with ``save_on_each_node``), crash-safely.

    Example:
        >>> save_custom_state(my_counter, "ckpt", index=0)
    """
    if writes_shared_files(save_on_each_node):
        write_custom_state(obj, path, index)


def deepspeed_required(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: the method may only run when the Accelerator is set up with DeepSpeed.

    Example:
        >>> @deepspeed_required
        ... def zero_stage(): ...
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        state = AcceleratorState()
        if str(getattr(state, "distributed_type", "")) != "DEEPSPEED":
            raise ConfigurationError(f"`{func.__name__}` needs DeepSpeed: pass `deepspeed_plugin=DeepSpeedPlugin(...)` "
                                     "to the Accelerator or launch with `hasten launch --use_deepspeed`.")
        return func(*args, **kwargs)

    return wrapper


def get_mixed_precision_context_manager(native_amp: bool = False, autocast_kwargs: Any = None) -> Any:
    """``torch.autocast`` for the Accelerator's mixed precision (fp16/bf16), or a do-nothing context.

    Example:
        >>> with get_mixed_precision_context_manager(native_amp=True):
        ...     loss = model(batch)
    """
    state = AcceleratorState()
    kwargs = autocast_kwargs.to_kwargs() if autocast_kwargs is not None else {}
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16}
    if not native_amp or state.mixed_precision not in dtypes:
        return contextlib.nullcontext()
    return torch.autocast(device_type=state.device.type, dtype=dtypes[state.mixed_precision], **kwargs)


__all__ = ["deepspeed_required", "get_mixed_precision_context_manager", "save", "save_custom_state",
           "writes_shared_files"]
