"""Accelerate's ``save_fsdp_model`` / ``load_fsdp_model`` / ``save_fsdp_optimizer`` / ``load_fsdp_optimizer`` for FSDP2.

Transformers' ``Trainer`` calls these on every checkpoint of an FSDP run and on resume. The files are
Accelerate's, so either library reads the other's checkpoints:

* ``FULL_STATE_DICT``: rank 0 writes ``pytorch_model_fsdp.bin`` (``pytorch_model_fsdp_{i}.bin`` for model
  ``i`` > 0) and ``optimizer.bin`` (``optimizer_{i}.bin``), gathered on CPU; loading reads them on rank 0
  only and shards them into the model by broadcast.
* ``SHARDED_STATE_DICT``: every rank writes its shards with ``torch.distributed.checkpoint`` into the
  folders ``pytorch_model_fsdp_{i}/`` (``{"model": ...}``) and ``optimizer_{i}/`` (``{"optimizer": ...}``).
  With ``use_dcp=False`` each rank writes ``..._{i}_rank{r}.bin`` instead.

Loading follows hasten's safe rules: ``.bin`` files through ``torch.load(weights_only=True)`` with an
allow-list, DCP folders through the checked reader (metadata read without running code, storage paths
confined to the folder). ``fsdp_plugin`` is read only for its ``state_dict_type``; ``accelerator`` for
``process_index``, ``num_processes`` and ``wait_for_everyone``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hasten.base.constants import FSDP_MODEL_NAME, OPTIMIZER_NAME
from hasten.base.imports import is_peft_model
from hasten.checkpointing import dcp
from hasten.checkpointing.safe_load import torch_load
from hasten.exceptions import ConfigurationError

logger = logging.getLogger(__name__)

_TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT")


def _state_dict_type(fsdp_plugin: Any) -> str:
    """The plugin's state-dict type as a name (hasten keeps a str; Accelerate an enum ``StateDictType.X``)."""
    value = getattr(fsdp_plugin, "state_dict_type", None) or "SHARDED_STATE_DICT"
    name = str(getattr(value, "name", value)).rpartition(".")[2]
    if name not in _TYPES:
        raise ConfigurationError(f"state_dict_type={value!r}: FSDP2 checkpoints are FULL_STATE_DICT or "
                                 "SHARDED_STATE_DICT (LOCAL_STATE_DICT is FSDP1's).")
    return name


def _options(full: bool, multi: bool, **extra: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # As Accelerate: a full state dict is gathered to rank 0's CPU memory when there are several processes.
    return StateDictOptions(full_state_dict=full, cpu_offload=full and multi, broadcast_from_rank0=full and multi,
                            **extra)


def _model_state(model: nn.Module, adapter_only: bool, options: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if adapter_only and is_peft_model(model):
        if options.full_state_dict:  # the trainable (adapter) weights only
            return get_model_state_dict(model, options=_copy(options, ignore_frozen_params=True))
        from peft import get_peft_model_state_dict

        return dict(get_peft_model_state_dict(model, adapter_name=model.active_adapter))
    return get_model_state_dict(model, options=options)


def _set_model_state(model: nn.Module, state: dict[str, Any], adapter_only: bool, options: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    if adapter_only and is_peft_model(model):
        if options.full_state_dict:
            return set_model_state_dict(model, state, options=_copy(options, strict=False))
        from peft import set_peft_model_state_dict

        return set_peft_model_state_dict(model, state, adapter_name=model.active_adapter)
    return set_model_state_dict(model, state, options=options)


def _copy(options: Any, **changes: Any) -> Any:
    from dataclasses import replace

    return replace(options, **changes)


def _save_file(state: Any, path: Path) -> None:
    """``torch.save`` to a temporary name, then rename: a crash never leaves half a file at ``path``."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def _full_name(prefix: str, index: int) -> str:
    return f"{prefix}.bin" if index == 0 else f"{prefix}_{index}.bin"


def _folder(base: str | os.PathLike[str], name: str) -> Path:
    """Accelerate accepts the checkpoint folder or the DCP folder itself."""
    base = Path(base)
    return base if base.name == name else base / name


def save_fsdp_model(fsdp_plugin: Any, accelerator: Any, model: nn.Module, output_dir: str | os.PathLike[str],
                    model_index: int = 0, adapter_only: bool = False, use_dcp: bool = True) -> None:
    """Save an FSDP2 model in Accelerate's layout (full file on rank 0, or DCP shards from every rank).

    Every process must call it. ``adapter_only`` saves only a PEFT model's adapter weights.

    Example:
        >>> save_fsdp_model(accelerator.state.fsdp_plugin, accelerator, model, "ckpt")  # doctest: +SKIP
    """
    kind = _state_dict_type(fsdp_plugin)
    os.makedirs(output_dir, exist_ok=True)
    options = _options(kind == "FULL_STATE_DICT", accelerator.num_processes > 1)
    state = _model_state(model, adapter_only, options)
    if kind == "FULL_STATE_DICT":
        if accelerator.process_index == 0:
            _save_file(state, Path(output_dir, _full_name(FSDP_MODEL_NAME, model_index)))
    elif use_dcp:
        import torch.distributed.checkpoint as dist_cp

        folder = Path(output_dir, f"{FSDP_MODEL_NAME}_{model_index}")
        folder.mkdir(parents=True, exist_ok=True)
        dist_cp.save({"model": state}, checkpoint_id=str(folder))
    else:
        _save_file(state, Path(output_dir, f"{FSDP_MODEL_NAME}_{model_index}_rank{accelerator.process_index}.bin"))
    logger.info("Saved model %d (%s) to %s", model_index, kind, output_dir)


def load_fsdp_model(fsdp_plugin: Any, accelerator: Any, model: nn.Module, input_dir: str | os.PathLike[str],
                    model_index: int = 0, adapter_only: bool = False, use_dcp: bool = True) -> Any:
    """Load a model saved by ``save_fsdp_model`` (hasten's or Accelerate's) into an FSDP2 model.

    Returns what ``set_model_state_dict`` returns (the missing and unexpected keys).

    Raises:
        CheckpointError: a file is missing, damaged or holds a type outside the allow-list.
    """
    kind = _state_dict_type(fsdp_plugin)
    accelerator.wait_for_everyone()
    multi = accelerator.num_processes > 1
    options = _options(kind == "FULL_STATE_DICT", multi)
    if kind == "FULL_STATE_DICT":
        path = Path(input_dir, _full_name(FSDP_MODEL_NAME, model_index))
        # With several processes rank 0 reads the file and the others receive their shards by broadcast.
        state = torch_load(path, path) if accelerator.process_index == 0 or not multi else {}
    elif use_dcp:
        folder = _folder(input_dir, f"{FSDP_MODEL_NAME}_{model_index}")
        holder = {"model": _model_state(model, adapter_only, options)}
        dcp._dcp_load(holder, folder)
        state = holder["model"]
    else:
        path = Path(input_dir, f"{FSDP_MODEL_NAME}_{model_index}_rank{accelerator.process_index}.bin")
        state = torch_load(path, path)
    result = _set_model_state(model, state, adapter_only, options)
    accelerator.wait_for_everyone()
    return result


def save_fsdp_optimizer(fsdp_plugin: Any, accelerator: Any, optimizer: torch.optim.Optimizer, model: nn.Module,
                        output_dir: str | os.PathLike[str], optimizer_index: int = 0, use_dcp: bool = True) -> None:
    """Save an FSDP2 model's optimizer state in Accelerate's layout (keyed by parameter names).

    Example:
        >>> save_fsdp_optimizer(accelerator.state.fsdp_plugin, accelerator, opt, model, "ckpt")  # doctest: +SKIP
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    kind = _state_dict_type(fsdp_plugin)
    os.makedirs(output_dir, exist_ok=True)
    state = get_optimizer_state_dict(model, optimizer,
                                     options=_options(kind == "FULL_STATE_DICT", accelerator.num_processes > 1))
    if kind == "FULL_STATE_DICT":
        if accelerator.process_index == 0:
            _save_file(state, Path(output_dir, _full_name(OPTIMIZER_NAME, optimizer_index)))
    elif use_dcp:
        import torch.distributed.checkpoint as dist_cp

        folder = Path(output_dir, f"{OPTIMIZER_NAME}_{optimizer_index}")
        folder.mkdir(parents=True, exist_ok=True)
        dist_cp.save({"optimizer": state}, checkpoint_id=str(folder))
    else:
        _save_file(state, Path(output_dir, f"{OPTIMIZER_NAME}_{optimizer_index}_rank{accelerator.process_index}.bin"))


def load_fsdp_optimizer(fsdp_plugin: Any, accelerator: Any, optimizer: torch.optim.Optimizer, model: nn.Module,
                        input_dir: str | os.PathLike[str], optimizer_index: int = 0, adapter_only: bool = False,
                        use_dcp: bool = True) -> None:
    """Load an optimizer state saved by ``save_fsdp_optimizer`` (hasten's or Accelerate's).

    Raises:
        CheckpointError: a file is missing, damaged or holds a type outside the allow-list.
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    kind = _state_dict_type(fsdp_plugin)
    accelerator.wait_for_everyone()
    multi = accelerator.num_processes > 1
    options = _options(kind == "FULL_STATE_DICT", multi)
    if kind == "FULL_STATE_DICT":
        path = Path(input_dir, _full_name(OPTIMIZER_NAME, optimizer_index))
        state = torch_load(path, path) if accelerator.process_index == 0 or not multi else {}
    elif use_dcp:
        # The current state gives DCP tensors of the right shards to read into (Adam's moments included).
        holder = {"optimizer": get_optimizer_state_dict(model, optimizer, options=options)}
        dcp._dcp_load(holder, _folder(input_dir, f"{OPTIMIZER_NAME}_{optimizer_index}"))
        state = holder["optimizer"]
    else:
        path = Path(input_dir, f"{OPTIMIZER_NAME}_{optimizer_index}_rank{accelerator.process_index}.bin")
        state = torch_load(path, path)
    set_optimizer_state_dict(model, optimizer, state, options=options)
    accelerator.wait_for_everyone()
