"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), and merging them into one file.

Layout inside a ``save_state`` folder (Accelerate's names, so ``merge-weights`` reads either library's
folders): ``pytorch_model_fsdp_{i}/`` holds model ``i`` as ``{"model": state_dict}`` and
``optimizer_{i}/`` holds optimizer ``i`` as ``{"optimizer": state_dict}``; each folder has DCP's
``.metadata`` plus one ``__{rank}_{n}.distcp`` file per writing rank. Every rank writes only its
shards. Reading checks the metadata (keys and global shapes) before anything is loaded.
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hasten.checkpointing.rng import CheckpointError
from hasten.checkpointing.safe_load import check_storage_paths, dcp_planner, dcp_reader, load_pickle
from hasten.checkpointing.sinks import ATOMIC, Sink

MODEL_DIR = "pytorch_model_fsdp_{index}"
OPTIMIZER_DIR = "optimizer_{index}"
METADATA_FILE = ".metadata"


def model_dir(folder: Path, index: int) -> Path:
    """The DCP folder of model ``index`` inside a checkpoint folder."""
    return folder / MODEL_DIR.format(index=index)


def optimizer_dir(folder: Path, index: int) -> Path:
    """The DCP folder of optimizer ``index`` inside a checkpoint folder."""
    return folder / OPTIMIZER_DIR.format(index=index)


def is_dcp_folder(path: Path) -> bool:
    """True when ``path`` is a complete DCP checkpoint (its metadata file is written last)."""
    return (path / METADATA_FILE).is_file()


def read_metadata(path: Path) -> Any:
    """DCP metadata of ``path`` (read without running code); CheckpointError naming the file otherwise."""
    if not is_dcp_folder(path):
        raise CheckpointError(f"{path} is not a torch.distributed.checkpoint folder (no {METADATA_FILE}); the save "
                              "was interrupted or the path is wrong.")
    metadata = load_pickle(path / METADATA_FILE)
    check_storage_paths(metadata, path)
    return metadata


def saved_tensor_shapes(path: Path, prefix: str) -> dict[str, tuple[int, ...]]:
    """``{name: global shape}`` of the tensors saved under ``prefix`` (e.g. ``"model"``) in a DCP folder."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    lead = f"{prefix}." if prefix else ""
    shapes: dict[str, tuple[int, ...]] = {}
    for key, meta in read_metadata(path).state_dict_metadata.items():
        if key.startswith(lead) and isinstance(meta, TensorStorageMetadata):
            shapes[key[len(lead):]] = tuple(meta.size)
    return shapes


def check_model_folder(model: nn.Module, path: Path) -> None:
    """Raise CheckpointError unless ``path`` holds exactly ``model``'s tensors with the same global shapes."""
    saved = saved_tensor_shapes(path, "model")
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    wrong = [f"{k}: saved {saved[k]} vs model {expected[k]}" for k in expected if k in saved and saved[k] != expected[k]]
    problems = [f"{label} {items[:8]}{' ...' if len(items) > 8 else ''}"
                for label, items in (("missing keys", missing), ("unexpected keys", unexpected),
                                     ("shape mismatches", wrong)) if items]
    if problems:
        raise CheckpointError(f"{path} does not match the prepared model {type(model).__name__}: "
                              + "; ".join(problems) + ". Nothing was loaded.")


def _param_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """``{name: global shape}`` of ``model``'s parameters (a DTensor's shape is the global one)."""
    return {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}


def _check_state_shapes(path: Path, params: Mapping[str, tuple[int, ...]],
                        saved: Mapping[str, tuple[int, ...]]) -> None:
    """``saved`` maps ``"<param name>.<state name>"`` to a global shape; each must belong to a parameter
    of the model and have its shape (scalars such as ``step`` excepted)."""
    unknown, wrong = [], []
    for key, shape in saved.items():
        owner = max((name for name in params if key.startswith(name + ".")), key=len, default=None)
        if owner is None:
            unknown.append(key)
        elif len(shape) == len(params[owner]) and shape != params[owner]:
            wrong.append(f"{key}: saved {shape} vs parameter {params[owner]}")
    problems = [f"{label} {items[:8]}{' ...' if len(items) > 8 else ''}"
                for label, items in (("state of parameters the model lacks", unknown), ("shape mismatches", wrong))
                if items]
    if problems:
        raise CheckpointError(f"{path} does not match the prepared optimizer: " + "; ".join(problems)
                              + ". Nothing was loaded.")


def _group_problem(path: Path, saved: int, live: int) -> CheckpointError:
    return CheckpointError(f"{path} holds {saved} optimizer parameter group(s) but the prepared optimizer has {live}; "
                           "create the optimizer with the groups it was saved with. Nothing was loaded.")


def check_optimizer_folder(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Raise CheckpointError unless the DCP folder ``path`` holds ``optimizer``'s state for ``model``:
    as many parameter groups, and per-parameter states of the parameters' global shapes."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_metadata(path).state_dict_metadata
    groups = {key.split(".")[2] for key in metadata if key.startswith("optimizer.param_groups.")}
    if groups and len(groups) != len(optimizer.param_groups):
        raise _group_problem(path, len(groups), len(optimizer.param_groups))
    lead = "optimizer.state."
    saved = {key[len(lead):]: tuple(meta.size) for key, meta in metadata.items()
             if key.startswith(lead) and isinstance(meta, TensorStorageMetadata)}
    _check_state_shapes(path, _param_shapes(model), saved)


def check_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: Any, path: Path) -> None:
    """Raise CheckpointError unless ``state`` (a gathered ``optimizer.bin``, keyed by parameter names) fits
    ``optimizer`` and ``model``: same groups of the same sizes, states of the parameters' shapes."""
    groups = state.get("param_groups") if isinstance(state, Mapping) else None
    if not isinstance(groups, list) or not isinstance(state.get("state"), Mapping) \
            or not all(isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups):
        raise CheckpointError(f"{path} is not an optimizer state (no 'state'/'param_groups'). Nothing was loaded.")
    if len(groups) != len(optimizer.param_groups):
        raise _group_problem(path, len(groups), len(optimizer.param_groups))
    sizes, live = [len(g["params"]) for g in groups], [len(g["params"]) for g in optimizer.param_groups]
    if sizes != live:
        raise CheckpointError(f"{path} holds parameter groups of sizes {sizes} but the optimizer's are {live}; the "
                              "model or optimizer differs from the saved one. Nothing was loaded.")
    saved = {f"{name}.{key}": tuple(value.shape) for name, entry in state["state"].items()
             if isinstance(entry, Mapping) for key, value in entry.items() if isinstance(value, torch.Tensor)}
    _check_state_shapes(path, _param_shapes(model), saved)


def _first_failure(exc: Any) -> tuple[int | None, Any]:
    """The first failing rank of DCP's CheckpointException and its reason (the exception itself if none)."""
    failures = getattr(exc, "failures", {}) or {}
    rank, first = next(iter(failures.items()), (None, exc))
    return rank, first[0] if isinstance(first, tuple) else first


def _dcp_load(state: dict[str, Any], path: Path, **kwargs: Any) -> None:
    """``dcp.load`` through the safe reader and planner; DCP's CheckpointException (a BaseException)
    becomes a CheckpointError carrying the first rank's reason."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=dcp_reader(path), planner=dcp_planner(path), **kwargs)
    except CheckpointException as exc:
        reason = _first_failure(exc)[1]
        if isinstance(reason, CheckpointError):
            raise CheckpointError(str(reason)) from None
        raise CheckpointError(f"Could not read the shards in {path}: {reason!r}. A .distcp file is missing or "
                              "damaged.") from None


_QUIET = [False]  # the filter below is installed
_SINGLE_PROCESS_WARNING = r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to save"


def _dcp_save(state: dict[str, Any], path: Path, sink: Sink) -> None:
    """``dcp.save`` of ``state`` to ``path`` through ``sink``: now, every process together on torch's
    default group (a synchronous save, a helper), or, for an asynchronous save's snapshot sink, only
    staged in host memory now and written by :func:`_write_shards` in the background."""
    sink.write_together(path, _write_shards, state)


def _write_shards(state: dict[str, Any], path: Path, group: Any) -> None:
    """The shards of ``state`` through ``dcp.save`` on ``group``: torch's default group on the calling
    thread, or the background threads' own gloo group for staged shards (None: a single process, no
    collectives). One planner and writer, so the same files either way: each rank's
    ``__{rank}_0.distcp`` (fsync'ed by DCP), then the coordinator's ``.metadata``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    if group is None and not _QUIET[0]:
        # One process: DCP warns that it "assumes the intent is to save in a single process", which is
        # the intent here. A filter for that message only, added once: catch_warnings() would swap the
        # process-wide filters from this background thread under the training loop's feet.
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING, category=UserWarning)
        _QUIET[0] = True
    try:
        dcp.save(state, checkpoint_id=str(path), process_group=group, no_dist=group is None)
    except CheckpointException as exc:  # a BaseException: raised on every process, with every rank's failure
        rank, reason = _first_failure(exc)
        where = "" if rank is None else f"process {rank}: "
        raise CheckpointError(f"{where}{type(reason).__name__}: {reason}") from None


# ----------------------------------------------------------------------------- sharded save / load
def save_state_dict(state: dict[str, Any], path: Path, *, sink: Sink = ATOMIC) -> None:
    """Every rank writes its part of ``state`` (any DCP state dict) to the DCP folder ``path`` through ``sink``;
    ranks may hold different keys (pipeline stages), and identical ones are written once."""
    _dcp_save(state, path, sink)


def load_state_dict(state: dict[str, Any], path: Path) -> None:
    """Every rank reads the keys of ``state`` (in place) from the DCP folder ``path``; the folder may hold more."""
    _dcp_load(state, path)


def save_model(model: nn.Module, path: Path, *, sink: Sink = ATOMIC) -> None:
    """Every rank writes its shards of ``model`` to the DCP folder ``path`` (an asynchronous save's sink: stages them)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    _dcp_save({"model": get_model_state_dict(model)}, path, sink)


def load_model(model: nn.Module, path: Path) -> None:
    """Every rank reads its shards of ``model`` from the DCP folder ``path`` (resharding if needed)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = {"model": get_model_state_dict(model)}
    _dcp_load(state, path)
    set_model_state_dict(model, state["model"])


def save_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path, *,
                   sink: Sink = ATOMIC) -> None:
    """Every rank writes its shards of ``optimizer``'s state (keyed by parameter names) to ``path``."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    _dcp_save({"optimizer": get_optimizer_state_dict(model, optimizer)}, path, sink)


def load_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Read ``optimizer``'s state from ``path``; hyper-parameters (lr, betas...) come back too."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    # get_optimizer_state_dict creates the lazily built state (Adam's moments) first, so DCP has
    # tensors of the right shards to read into even before the first step.
    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    _dcp_load(state, path)
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


# ------------------------------------------------------------------------------- full (gathered)
def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The gathered state dict on CPU, on rank 0 only (other ranks get ``{}``); every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state: dict[str, Any] = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return state


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The gathered optimizer state dict on CPU, on rank 0 only; every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_model_state(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Shard rank 0's full ``state`` into ``model`` (the other ranks pass ``{}``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, dict(state),
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """Shard rank 0's full optimizer ``state`` into ``optimizer`` (the other ranks pass ``{}``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, dict(state),
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


# ------------------------------------------------------------------------------------- merging
def read_full_state(path: Path) -> dict[str, torch.Tensor]:
    """Read every tensor of a DCP model folder in one process (no process group), keys without ``model.``."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_metadata(path)
    tensors = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
               for key, meta in metadata.state_dict_metadata.items() if isinstance(meta, TensorStorageMetadata)}
    if not tensors:
        raise CheckpointError(f"{path} holds no tensors to merge.")
    try:
        with warnings.catch_warnings():  # loading in one process is the point here, not a mistake
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            _dcp_load(tensors, path, no_dist=True)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"Could not read the shards in {path}: {exc}. A .distcp file is missing or damaged.") from exc
    if all(key.startswith("model.") for key in tensors):
        tensors = {key[len("model."):]: value for key, value in tensors.items()}
    return tensors


def _model_folders(checkpoint_dir: Path) -> list[Path]:
    """The DCP model folders named by ``checkpoint_dir``: itself, or the ``pytorch_model_fsdp_*`` inside it."""
    if is_dcp_folder(checkpoint_dir):
        return [checkpoint_dir]
    folders: list[Path] = []
    while is_dcp_folder(model_dir(checkpoint_dir, len(folders))):
        folders.append(model_dir(checkpoint_dir, len(folders)))
    if not folders:
        raise CheckpointError(f"{checkpoint_dir} is neither a torch.distributed.checkpoint folder nor a save_state "
                              f"folder holding {MODEL_DIR.format(index=0)}/ (saved with state_dict_type="
                              "'SHARDED_STATE_DICT').")
    return folders


def merge_sharded_weights(checkpoint_dir: str | Path, output_path: str | Path, safe_serialization: bool = True,
                          remove_checkpoint_dir: bool = False) -> list[Path]:
    """Merge a sharded model checkpoint into ``output_path/model.safetensors`` (or ``pytorch_model.bin``).

    ``checkpoint_dir`` is a DCP model folder (``pytorch_model_fsdp_0``) or a ``save_state`` folder;
    with several models in it, model ``i`` goes to ``model_{i}.safetensors``. Runs in one process
    on the CPU. Accelerate's ``merge_fsdp_weights`` with the same arguments.

    Example:
        >>> merge_sharded_weights("ckpt/checkpoint_0", "merged")
        [PosixPath('merged/model.safetensors')]

    Raises:
        CheckpointError: the folder is not a sharded checkpoint, or a shard is missing or damaged.
    """
    from hasten.checkpointing.files import save_model_weights

    source = Path(checkpoint_dir).expanduser()
    if not source.is_dir():
        raise CheckpointError(f"Checkpoint folder {source} does not exist.")
    folders = _model_folders(source)
    target = Path(output_path).expanduser()
    target.mkdir(parents=True, exist_ok=True)
    written = [save_model_weights(read_full_state(folder), target, index, safe_serialization)
               for index, folder in enumerate(folders)]
    if remove_checkpoint_dir:
        shutil.rmtree(source)
    return written


#: Accelerate's name (``accelerate.utils.merge_fsdp_weights``), same arguments.
merge_fsdp_weights = merge_sharded_weights

__all__ = ["MODEL_DIR", "OPTIMIZER_DIR", "check_full_optimizer_state", "check_model_folder", "check_optimizer_folder", "full_model_state", "full_optimizer_state",
           "is_dcp_folder", "load_full_model_state", "load_full_optimizer_state", "load_model", "load_optimizer",
           "merge_fsdp_weights", "merge_sharded_weights", "model_dir", "optimizer_dir", "read_full_state", "read_metadata", "save_model",
           "load_state_dict", "save_optimizer", "save_state_dict", "saved_tensor_shapes"]
