"""Module sizes and memory budgets: ``compute_module_sizes``, ``get_max_memory``, ``get_balanced_memory``."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

import torch
from torch import nn

from hasten.base.sizes import convert_file_size_to_int
from hasten.big_modeling.tensors import dtype_byte_size, is_integer_dtype, named_module_tensors, str_to_dtype

logger = logging.getLogger(__name__)

__all__ = ["calculate_maximum_sizes", "compute_module_sizes", "compute_module_total_buffer_size",
           "convert_file_size_to_int", "get_balanced_memory", "get_max_layer_size", "get_max_memory"]


def _tensor_size(tensor: torch.Tensor, dtype_size: float | None, special: float | None) -> float:
    if special is not None:
        return tensor.numel() * special
    own = dtype_byte_size(tensor.dtype)
    if dtype_size is None or is_integer_dtype(tensor.dtype):  # int/bool tensors are never cast
        return tensor.numel() * own
    return tensor.numel() * min(dtype_size, own)


def compute_module_sizes(model: nn.Module, dtype: str | torch.dtype | None = None,
                         special_dtypes: Mapping[str, str | torch.dtype] | None = None,
                         buffers_only: bool = False) -> defaultdict[str, int]:
    """Bytes of every module and tensor, keyed by name; ``""`` is the whole model.

    With ``dtype``, floating tensors count at ``min(dtype, their own dtype)`` size; ``special_dtypes`` overrides
    single tensors. Tied parameters count once (under their first name).

    Example:
        >>> compute_module_sizes(nn.Linear(3, 4))[""]
        64
    """
    dtype_size = dtype_byte_size(str_to_dtype(dtype)) if dtype is not None else None
    specials = {k: dtype_byte_size(str_to_dtype(v)) for k, v in (special_dtypes or {}).items()}
    sizes: defaultdict[str, Any] = defaultdict(int)  # sub-byte dtypes give fractional sizes
    tensors: Iterable[tuple[str, torch.Tensor]] = (
        model.named_buffers(recurse=True) if buffers_only else named_module_tensors(model, recurse=True))
    per_module: dict[str, Any] = {}  # bytes held directly by each module: its ancestors are added once per module
    for name, tensor in tensors:
        size = _tensor_size(tensor, dtype_size, specials.get(name) if specials else None)
        sizes[name] += size
        owner = name.rpartition(".")[0]
        per_module[owner] = per_module.get(owner, 0) + size
    for owner, size in per_module.items():
        if not owner:
            sizes[""] += size
            continue
        parts = owner.split(".")
        for index in range(len(parts) + 1):
            sizes[".".join(parts[:index])] += size
    return sizes


def compute_module_total_buffer_size(model: nn.Module, dtype: str | torch.dtype | None = None,
                                     special_dtypes: Mapping[str, str | torch.dtype] | None = None) -> int:
    """Bytes of all the buffers of ``model``.

    Example:
        >>> compute_module_total_buffer_size(nn.BatchNorm1d(4))
        40
    """
    return compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes, buffers_only=True).get("", 0)


def get_max_layer_size(modules: list[tuple[str, Any]], module_sizes: Mapping[str, int],
                       no_split_module_classes: list[str]) -> tuple[int, list[str]]:
    """The largest "layer" among ``modules``: a leaf module or a module of a no-split class.

    Returns:
        ``(size, names)``: the largest size and every layer that has it.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 4))
        >>> get_max_layer_size(list(model.named_children()), compute_module_sizes(model), [])
        (48, ['1'])
    """
    max_size, names = 0, []
    pending = list(modules)
    while pending:
        name, module = pending.pop(0)
        children = list(module.named_children()) if isinstance(module, nn.Module) else []
        if not children or type(module).__name__ in no_split_module_classes:
            size = module_sizes[name]
            if size > max_size:
                max_size, names = size, [name]
            elif size == max_size:
                names.append(name)
        else:
            pending = [(f"{name}.{n}", m) for n, m in children] + pending
    return max_size, names


def calculate_maximum_sizes(model: nn.Module) -> tuple[int, tuple[int, list[str]]]:
    """``(total size, (largest layer size, its names))`` of ``model`` (no-split classes from ``_no_split_modules``).

    Example:
        >>> calculate_maximum_sizes(nn.Sequential(nn.Linear(2, 2)))
        (24, (24, ['0']))
    """
    sizes = compute_module_sizes(model)
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    modules = list(model.named_children()) or [("", model)]
    return sizes[""], get_max_layer_size(modules, sizes, no_split)


def _sort_budget(max_memory: dict[Any, int]) -> dict[Any, int]:
    gpus = sorted(k for k in max_memory if isinstance(k, int))
    others = [k for k in ("mps", "cpu", "disk") if k in max_memory]
    unknown = [k for k in max_memory if k not in gpus and k not in others]
    if unknown:
        raise ValueError(f"Device {unknown[0]!r} in `max_memory` is not recognized: use integers for GPUs, "
                         "'mps', 'cpu' or 'disk'.")
    return {k: max_memory[k] for k in gpus + others}


def get_max_memory(max_memory: Mapping[Any, int | str] | None = None) -> dict[Any, int]:
    """Memory budget per device, GPUs (ints) first, then ``"mps"``, ``"cpu"`` and ``"disk"``.

    With ``max_memory`` given, its string sizes are converted (in the caller's dict too, as in Accelerate)
    and **no accelerator is queried**; otherwise the free memory of every visible GPU and the available RAM
    (psutil) are measured.

    Example:
        >>> get_max_memory({0: "1GB", "cpu": "2GiB"})
        {0: 1000000000, 'cpu': 2147483648}
    """
    if max_memory is not None:
        converted: dict[Any, int] = {}
        for key, value in max_memory.items():
            try:
                converted[int(key) if isinstance(key, str) and key.isdigit() else key] = convert_file_size_to_int(value)
            except ValueError as exc:
                raise ValueError(f"max_memory[{key!r}] = {value!r} is not a size: use an int (bytes) or a "
                                 "string like '10GB' or '512MiB'.") from exc
        if isinstance(max_memory, MutableMapping):
            # As Accelerate does, the caller's dict gets its sizes in bytes (keys untouched): Transformers
            # compares the dict it passed with ints afterwards.
            for key, value in max_memory.items():
                if isinstance(value, str):
                    max_memory[key] = convert_file_size_to_int(value)
        return _sort_budget(converted)
    budget: dict[Any, int] = {}
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            try:
                budget[index] = torch.cuda.mem_get_info(index)[0]
            except Exception:  # a GPU that cannot be queried gets no budget rather than crashing the call
                logger.info("Device %d seems unavailable; it gets no memory budget.", index)
    elif getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        budget["mps"] = available_ram()
        return budget
    budget["cpu"] = available_ram()
    return budget


def available_ram() -> int:
    """Bytes of RAM available to a new allocation without swapping (``MemAvailable``, as psutil reports it).

    On Linux it is read from ``/proc/meminfo`` directly: importing psutil costs more (about 8 ms) than the
    whole memory-mapped load of a checkpoint, and ``device_map="auto"`` asks for this on every load.
    """
    try:
        with open("/proc/meminfo", "rb") as meminfo:
            for line in meminfo:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import psutil  # other systems, and kernels older than 3.14 without MemAvailable

    return int(psutil.virtual_memory().available)


def _no_split_block_size(model: nn.Module, module_sizes: Mapping[str, int], classes: list[str]) -> int:
    found: dict[str, int] = {}
    for name, module in model.named_modules():
        cls = type(module).__name__
        if name and cls in classes and cls not in found:
            found[cls] = module_sizes.get(name, 0)
            if len(found) == len(set(classes)):
                break
    return max(found.values(), default=0)


def _mean_leaf_module_size(module_sizes: Mapping[str, int]) -> int:
    # Leaves of the size table are tensors; once they are dropped, the new leaves are the innermost modules.
    names = set(module_sizes)
    parents = {n.rsplit(".", 1)[0] if "." in n else "" for n in names if n}
    modules = {n for n in names if n in parents}
    module_parents = {n.rsplit(".", 1)[0] if "." in n else "" for n in modules if n}
    leaves = [n for n in modules if n and n not in module_parents]
    return int(sum(module_sizes[n] for n in leaves) / max(len(leaves), 1))


def get_balanced_memory(model: nn.Module, max_memory: Mapping[Any, int | str] | None = None,
                        no_split_module_classes: list[str] | None = None, dtype: str | torch.dtype | None = None,
                        special_dtypes: Mapping[str, str | torch.dtype] | None = None,
                        low_zero: bool = False) -> dict[Any, int]:
    """Lower the GPU budgets so that ``infer_auto_device_map`` spreads the model evenly over the GPUs.

    Each GPU but the last gets ``total / n_gpus`` plus a buffer of ``1.25 x max(largest no-split block,
    mean leaf module)``; the last keeps its whole budget. ``low_zero`` leaves GPU 0 as empty as possible
    (for ``generate`` outputs). With one GPU and no user budget, 90% of it is used.

    Example:
        >>> get_balanced_memory(model, max_memory={0: 300, 1: 300})  # model of 236 bytes
        {0: 215, 1: 300}
    """
    user_set = max_memory is not None
    budget = get_max_memory(max_memory)
    gpus = [k for k, v in budget.items() if isinstance(k, int) and v > 0]
    if not gpus:
        return budget
    if len(gpus) == 1:
        low_zero = False
        if not user_set:
            budget[gpus[0]] = int(budget[gpus[0]] * 0.9)
    if no_split_module_classes is None:
        no_split_module_classes = []
    elif not isinstance(no_split_module_classes, (list, tuple)):
        no_split_module_classes = [no_split_module_classes]
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    per_gpu = sizes[""] // (len(gpus) - 1 if low_zero else len(gpus))
    block = _no_split_block_size(model, sizes, list(no_split_module_classes)) if no_split_module_classes else 0
    per_gpu += int(1.25 * max(block, _mean_leaf_module_size(sizes)))
    for index in gpus[:-1]:
        budget[index] = min(budget[index] if low_zero and index == gpus[0] else per_gpu, budget[index])
    if low_zero:
        needed_on_zero = max(0, sizes[""] - sum(budget[i] for i in gpus[1:]))
        budget[gpus[0]] = min(needed_on_zero, budget[gpus[0]])
    return budget
