"""Small helpers around environment variables (one of the few places allowed to touch ``os.environ``)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from hasten._lazy import accelerate_path_getattr

_TRUE = {"1", "true", "yes", "y", "on", "t"}
_FALSE = {"0", "false", "no", "n", "off", "f", ""}


def str_to_bool(value: str, to_bool: bool = False) -> int | bool:
    """Convert a truthy/falsy string to 1 or 0 (``True``/``False`` with ``to_bool``), as Accelerate does.

    Example:
        >>> str_to_bool("yes"), str_to_bool("off", to_bool=True)
        (1, False)

    Raises:
        ValueError: the string is neither truthy nor falsy.
    """
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True if to_bool else 1
    if lowered in _FALSE:
        return False if to_bool else 0
    raise ValueError(f"invalid truth value {value!r}: use one of {sorted(_TRUE | _FALSE - {''})}")


def as_bool(value: Any, name: str = "value", owner: str = "") -> bool:
    """The one boolean parser for settings: ``True``/``False``, ``0``/``1``, or a truthy/falsy string.

    Example:
        >>> as_bool("Yes"), as_bool(0), as_bool(False)
        (True, False, False)

    Raises:
        ConfigurationError: anything else (``2``, ``"maybe"``, ``None``), naming ``name`` (and the
            class or function ``owner`` it was passed to).
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip():
        try:
            return bool(str_to_bool(value))
        except ValueError:
            pass
    from hasten.exceptions import ConfigurationError

    setting = f"{owner}({name}={value!r})" if owner else f"{name}={value!r}"
    raise ConfigurationError(f"{setting} must be true or false (also accepted: 1/0, yes/no, on/off).")


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    """Read a boolean flag from the environment: ``parse_flag_from_env("HASTEN_DEBUG_MODE")``."""
    value = os.environ.get(key)
    return default if value is None else bool(str_to_bool(value))


def parse_choice_from_env(key: str, default: str = "no") -> str:
    """Read a string setting from the environment, ``default`` when unset."""
    return os.environ.get(key, str(default))


def get_int_from_env(env_keys: list[str], default: int) -> int:
    """Return the first non-negative integer found under ``env_keys`` in the environment, else ``default``."""
    return int_from_env(env_keys, default, os.environ)


def int_from_env(env_keys: list[str], default: int, env: Mapping[str, str]) -> int:
    """``get_int_from_env`` over an explicit mapping (hasten reads environments as pure functions)."""
    for key in env_keys:
        value = int(env.get(key, -1))
        if value >= 0:
            return value
    return default


@contextmanager
def patch_environment(**kwargs: Any) -> Iterator[None]:
    """Temporarily set environment variables (keys are upper-cased), restoring them on exit.

    Example:
        >>> with patch_environment(master_port="29501"):
        ...     pass
    """
    saved: dict[str, str | None] = {}
    for key, value in kwargs.items():
        key = key.upper()
        saved[key] = os.environ.get(key)
        os.environ[key] = str(value)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def current_environment() -> Mapping[str, str]:
    """The process environment, for code that must pass an env mapping to pure functions."""
    return os.environ


def is_env_set(key: str) -> bool:
    """True when the variable ``key`` is present in this process's environment."""
    return key in os.environ


@contextmanager
def clear_environment() -> Iterator[None]:
    """Run the block with an empty ``os.environ``, restoring the original afterwards."""
    saved = dict(os.environ)
    os.environ.clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def purge_accelerate_environment(func_or_cls: Any) -> Any:
    """Decorator (function or test class): remove the ``ACCELERATE_*`` and ``HASTEN_*`` variables the
    decorated code sets, so they do not leak into what runs next."""
    import functools
    import inspect

    prefixes = ("ACCELERATE_", "HASTEN_")

    def wrap(function: Any) -> Any:
        if getattr(function, "_accelerate_is_purged_environment_wrapped", False):
            return function  # stacked decorators, or a parent class already wrapped it

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            before = {k: v for k, v in os.environ.items() if k.startswith(prefixes)}
            try:
                return function(*args, **kwargs)
            finally:
                for key in [k for k in os.environ if k.startswith(prefixes)]:
                    if key not in before:
                        del os.environ[key]
                os.environ.update(before)

        wrapper._accelerate_is_purged_environment_wrapped = True  # type: ignore[attr-defined]
        return wrapper

    def wrap_class(cls: Any) -> Any:
        # every test method, inherited ones included (unittest and pytest-style classes alike)
        for name in dir(cls):
            member = getattr(cls, name, None)
            if name.startswith("test") and callable(member) and not inspect.isclass(member):
                setattr(cls, name, wrap(member))
        return cls

    if inspect.isclass(func_or_cls):
        wrap_class(func_or_cls)
        previous = func_or_cls.__dict__.get("__init_subclass__")

        def init_subclass(cls: Any, **kwargs: Any) -> None:  # subclasses' own tests are covered too
            if previous is not None:
                previous.__func__(cls, **kwargs)
            wrap_class(cls)

        func_or_cls.__init_subclass__ = classmethod(init_subclass)  # type: ignore[method-assign,assignment]
        return func_or_cls
    return wrap(func_or_cls)


def convert_dict_to_env_variables(current_env: dict[str, str]) -> list[str]:
    """``["KEY=value\\n", ...]`` lines for a ``.env`` file; keys or values with spaces, ``;`` or ``=`` are
    skipped (with a warning), since they could not be read back safely."""
    import warnings

    lines = []
    for key, value in current_env.items():
        if any(ch in f"{key}{value}" for ch in (" ", ";", "\n")) or "=" in key:
            warnings.warn(f"skipping environment variable {key!r}: its name or value has spaces, `;` or `=`",
                          stacklevel=2)
            continue
        lines.append(f"{key}={value}\n")
    return lines


def enable_fsdp_ram_efficient_loading() -> None:
    """Load pretrained weights on rank 0 only and broadcast them when FSDP shards the model."""
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "true"


def disable_fsdp_ram_efficient_loading() -> None:
    """Undo :func:`enable_fsdp_ram_efficient_loading`."""
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "false"


#: Accelerate's switch for looking for torch_xla (hasten has no TPU path; kept for code that reads it).
USE_TORCH_XLA: bool = bool(str_to_bool(os.environ.get("USE_TORCH_XLA", "true")))


@dataclasses.dataclass
class CPUInformation:
    """Where this process sits in a CPU run: rank, world size, local rank, local world size."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1


def get_cpu_distributed_information() -> CPUInformation:
    """Rank, world size, local rank and local world size from the MPI/torchrun variables of this process."""
    read = lambda keys: int_from_env(keys, 0 if "RANK" in keys[0] else 1, os.environ)  # noqa: E731
    return CPUInformation(
        rank=int_from_env(["RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK"], 0, os.environ),
        world_size=read(["WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"]),
        local_rank=int_from_env(["LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK",
                                 "MV2_COMM_WORLD_LOCAL_RANK"], 0, os.environ),
        local_world_size=read(["LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE",
                               "MV2_COMM_WORLD_LOCAL_SIZE"]))


def accelerate_dynamo_env() -> dict[str, Any]:
    """``TorchDynamoPlugin`` settings from Accelerate's ``ACCELERATE_DYNAMO_*`` variables (only those set):
    backend, mode, fullgraph, use_regional_compilation, dynamic."""
    names = {"BACKEND": "backend", "MODE": "mode", "USE_FULLGRAPH": "fullgraph",
             "USE_REGIONAL_COMPILATION": "use_regional_compilation", "USE_DYNAMIC": "dynamic"}
    found: dict[str, Any] = {}
    for suffix, field in names.items():
        raw = os.environ.get(f"ACCELERATE_DYNAMO_{suffix}")
        if raw is not None:
            found[field] = raw if field in ("backend", "mode") else bool(str_to_bool(raw))
    return found


def env_var_path_add(env_var_name: str, path_to_add: Any) -> str:
    """The value of the ``:``-separated path variable ``env_var_name`` with ``path_to_add`` appended (the
    caller sets it).

    Example:
        >>> os.environ["PYTHONPATH"] = env_var_path_add("PYTHONPATH", "/opt/lib")
    """
    paths = [p for p in os.environ.get(env_var_name, "").split(":") if p]
    return ":".join([*paths, str(path_to_add)])


def get_driver_version() -> str:
    """The NVIDIA driver version of the first GPU, from ``nvidia-smi``."""
    import subprocess

    output = subprocess.check_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                     text=True)
    return output.strip().split(os.linesep)[0]


def override_numa_affinity(local_process_index: int, verbose: bool | None = None) -> None:
    """Pin this process to its GPU's NUMA node now (:func:`set_numa_affinity` recomputes it on every call)."""
    set_numa_affinity(local_process_index, verbose=verbose)


def set_numa_affinity(local_process_index: int, verbose: bool | None = None) -> None:
    """Pin this process to the CPUs of its GPU's NUMA node (Linux with CUDA GPUs; elsewhere nothing to do)."""
    import torch

    if not torch.cuda.is_available() or not hasattr(os, "sched_setaffinity"):
        return
    bus_id = torch.cuda.get_device_properties(local_process_index)
    pci = getattr(bus_id, "pci_bus_id", None)
    if pci is None:
        return
    node_file = f"/sys/bus/pci/devices/{str(pci).lower()}/numa_node"
    try:
        with open(node_file) as handle:
            node = int(handle.read().strip())
        with open(f"/sys/devices/system/node/node{max(node, 0)}/cpulist") as handle:
            cpulist = handle.read().strip()
    except (OSError, ValueError):
        return
    cpus: set[int] = set()
    for part in cpulist.split(","):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    os.sched_setaffinity(0, cpus)
    if verbose:
        print(f"Assigning {len(cpus)} CPU cores of NUMA node {node} to process {local_process_index}")


def get_current_device_type() -> tuple[str, str]:
    """``(device type, torch.distributed backend)`` of this machine: ``("cuda", "nccl")`` or ``("cpu", "gloo")``."""
    import torch

    if torch.cuda.is_available():
        return "cuda", "nccl"
    return "cpu", "gloo"


def get_gpu_info() -> tuple[list[str], int]:
    """The names and count of the CUDA GPUs visible here."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [torch.cuda.get_device_name(i) for i in range(count)], count


def check_cuda_p2p_ib_support() -> bool:
    """False when the GPUs are consumer RTX 3090/4000-series cards, whose P2P/InfiniBand paths NCCL must avoid."""
    names, count = get_gpu_info()
    return not (count > 1 and any(("RTX 40" in n or "RTX 3090" in n) for n in names))


def check_cuda_fp8_capability() -> bool:
    """Whether the current CUDA GPU computes in fp8 (compute capability 8.9 or newer)."""
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


# Names Accelerate shows at this module path but hasten defines elsewhere (hasten/_accelerate_paths.py).
__getattr__ = accelerate_path_getattr(__name__, globals())
