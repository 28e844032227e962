"""Seeding and RNG synchronisation across processes."""

from __future__ import annotations

import random
from collections.abc import Iterable

import numpy as np
import torch
import torch.distributed as dist

from hasten.ops.collectives import is_distributed


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed Python's ``random``, NumPy and torch (CPU and every CUDA device).

    Args:
        seed: the seed.
        device_specific: add the process's global rank, so each process draws different numbers.
        deterministic: also ask torch for deterministic algorithms.

    Example:
        >>> set_seed(42)
    """
    if device_specific and dist.is_available() and dist.is_initialized():
        seed += dist.get_rank()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device
    if deterministic:
        torch.use_deterministic_algorithms(True)


def _broadcast_state(state: torch.Tensor) -> torch.Tensor:
    # RNG states are CPU byte tensors; NCCL groups need them on the GPU for the broadcast.
    if dist.get_backend() == "nccl":
        moved = state.to(torch.device("cuda", torch.cuda.current_device()))
        dist.broadcast(moved, src=0)
        return moved.cpu()
    state = state.clone()
    dist.broadcast(state, src=0)
    return state


def synchronize_rng_state(rng_type: str | None = None, generator: torch.Generator | None = None) -> None:
    """Give every process rank 0's state of one generator (``"torch"``, ``"cuda"`` or ``"generator"``).

    Raises:
        ValueError: an unknown ``rng_type``, or ``"generator"`` without a generator.
    """
    if not is_distributed():
        return
    kind = str(rng_type) if rng_type is not None else "torch"
    if kind == "torch":
        torch.set_rng_state(_broadcast_state(torch.get_rng_state()))
    elif kind == "cuda":
        if torch.cuda.is_available():
            torch.cuda.set_rng_state(_broadcast_state(torch.cuda.get_rng_state()))
    elif kind == "generator":
        if generator is None:
            raise ValueError("synchronize_rng_state('generator') needs the `generator` to synchronise")
        generator.set_state(_broadcast_state(generator.get_state()))
    else:
        raise ValueError(f"synchronize_rng_state: unsupported rng_type {rng_type!r}; use 'torch', 'cuda' or 'generator'")


def synchronize_rng_states(rng_types: Iterable[str], generator: torch.Generator | None = None) -> None:
    """Synchronise each generator named in ``rng_types`` from rank 0 (see :func:`synchronize_rng_state`)."""
    for rng_type in rng_types:
        synchronize_rng_state(rng_type, generator=generator)
