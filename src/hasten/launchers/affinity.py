"""``hasten launch --enable_cpu_affinity``: pin each local rank to its own share of this machine's cores.

The worker bootstrap (:mod:`hasten.launchers.worker`) calls :func:`pin_local_rank` before the script
starts. On a GPU launch a rank gets cores of the NUMA node its GPU is attached to (read from
``/sys``), split among the local ranks whose GPUs share that node, as Accelerate does with NVML; on a
CPU launch, or when the GPU's node is unknown, the cores this process may use are split into
contiguous, near-equal parts, one per local rank. Only Linux has ``sched_setaffinity``: elsewhere the
launcher refuses the option (:func:`check_affinity_supported`) instead of ignoring it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from hasten.config.schema import LaunchConfig
from hasten.exceptions import ConfigurationError

SYS_ROOT = Path("/sys")


def check_affinity_supported(config: LaunchConfig, no_python: bool = False) -> None:
    """Refuse ``enable_cpu_affinity`` where the workers cannot apply it.

    Raises:
        ConfigurationError: not Linux (no ``os.sched_setaffinity``), or ``--no_python`` (the
            executable does not start through hasten's worker bootstrap, which does the pinning).
    """
    if not config.enable_cpu_affinity:
        return
    if not hasattr(os, "sched_setaffinity"):
        raise ConfigurationError("enable_cpu_affinity=True needs Linux (os.sched_setaffinity); this system has no "
                                 "way to pin a process to cores. HINT: drop --enable_cpu_affinity (or set "
                                 "enable_cpu_affinity: false in the config file).")
    if no_python:
        raise ConfigurationError("--enable_cpu_affinity cannot be used with --no_python: the cores are pinned by "
                                 "hasten's Python worker bootstrap, which an executable does not run through. "
                                 "HINT: pin the executable yourself (taskset) or drop --no_python.")


def parse_cpulist(text: str) -> list[int]:
    """Parse a kernel CPU list (``"0-3,8,10-11"``) into sorted core ids.

    Example:
        >>> parse_cpulist("0-2,8,10-11")
        [0, 1, 2, 8, 10, 11]
    """
    cores: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return sorted(cores)


def cpu_share(cores: Sequence[int], index: int, parts: int) -> list[int]:
    """The ``index``-th of ``parts`` contiguous, near-equal slices of ``cores`` (never empty).

    With fewer cores than parts, ranks share cores round-robin (one core each).

    Example:
        >>> [cpu_share(range(5), i, 2) for i in range(2)]
        [[0, 1, 2], [3, 4]]
    """
    ordered = sorted(cores)
    if not ordered:
        raise ValueError("no cores to share")
    if parts <= 0 or not 0 <= index < parts:
        raise ValueError(f"index {index} is outside 0..{parts - 1}")
    if len(ordered) < parts:
        return [ordered[index % len(ordered)]]
    base, extra = divmod(len(ordered), parts)
    start = index * base + min(index, extra)
    return ordered[start:start + base + (1 if index < extra else 0)]


def numa_node_cores(node: int, sys_root: Path = SYS_ROOT) -> list[int] | None:
    """The cores of NUMA node ``node`` (``None`` when ``/sys`` does not say)."""
    try:
        return parse_cpulist((sys_root / "devices" / "system" / "node" / f"node{node}" / "cpulist").read_text())
    except (OSError, ValueError):
        return None


def gpu_numa_nodes(count: int, sys_root: Path = SYS_ROOT) -> list[int | None]:
    """The NUMA node of each of the first ``count`` visible CUDA devices (``None`` where unknown)."""
    import torch

    nodes: list[int | None] = []
    for index in range(count):
        props = torch.cuda.get_device_properties(index)
        bus = getattr(props, "pci_bus_id", None)
        if bus is None:
            nodes.append(None)
            continue
        address = (f"{getattr(props, 'pci_domain_id', 0):04x}:{bus:02x}:"
                   f"{getattr(props, 'pci_device_id', 0):02x}.0")
        try:
            node = int((sys_root / "bus" / "pci" / "devices" / address / "numa_node").read_text())
        except (OSError, ValueError):
            node = -1
        nodes.append(node if node >= 0 else None)
    return nodes


def _uses_gpu(config: LaunchConfig) -> bool:
    if config.use_cpu or config.distributed_type == "MULTI_CPU":
        return False
    import torch

    return torch.cuda.is_available()


def cores_for_local_rank(config: LaunchConfig, local_rank: int, local_world_size: int, allowed: Sequence[int],
                         sys_root: Path = SYS_ROOT) -> list[int]:
    """The cores local rank ``local_rank`` is pinned to (see the module docstring for the rule)."""
    if _uses_gpu(config):
        import torch

        nodes = gpu_numa_nodes(min(local_world_size, torch.cuda.device_count()), sys_root)
        mine = nodes[local_rank] if local_rank < len(nodes) else None
        node_cores = numa_node_cores(mine, sys_root) if mine is not None else None
        usable = sorted(set(node_cores or ()) & set(allowed))
        if mine is not None and usable:
            peers = [rank for rank, node in enumerate(nodes) if node == mine]
            return cpu_share(usable, peers.index(local_rank), len(peers))
    return cpu_share(allowed, local_rank, local_world_size)


def pin_local_rank(config: LaunchConfig, env: Mapping[str, str]) -> list[int] | None:
    """Pin this worker process to its cores when ``config.enable_cpu_affinity``; return them (or ``None``)."""
    if not config.enable_cpu_affinity:
        return None
    from hasten.environments.detect import detect_process_info

    _, info = detect_process_info(env)
    cores = cores_for_local_rank(config, info.local_rank, max(info.local_world_size, 1),
                                 sorted(os.sched_getaffinity(0)))
    os.sched_setaffinity(0, cores)
    return cores
