"""Every random generator's state in a form ``torch.load(weights_only=True)`` accepts.

Accelerate pickles NumPy's state object, which PyTorch >= 2.6 refuses to load with ``weights_only`` and
whose failure Accelerate then swallows. hasten stores plain ints, lists and tensors, and a state that
cannot be restored is an error.
"""

from __future__ import annotations

import random
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hasten.exceptions import CheckpointError  # re-exported: its home before it moved to hasten.exceptions


def capture_rng_state(step: int) -> dict[str, Any]:
    """Python, NumPy, torch and CUDA generator states plus the accumulation ``step`` counter."""
    version, py_state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "step": int(step),
        "format": "hasten-rng-1",
        "random_state": [int(version), [int(x) for x in py_state], gauss],
        "numpy_random_seed": [str(kind), torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss),
                              float(cached)],
        "torch_manual_seed": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    return state


def derive_rng_state(state: dict[str, Any], process_index: int) -> dict[str, Any]:
    """The generator states of a process the saving run did not have, derived from another's ``state``.

    Rule: ``seed = crc32(str(process_index), crc32(bytes of the source's torch CPU generator state))``;
    Python's ``random``, NumPy's global generator, torch's CPU generator and every CUDA generator
    (device ``i`` gets ``seed + i``) are seeded with it, as ``set_seed(seed)`` would. The result depends
    only on the checkpoint and the process index, so every resume on that count is reproducible, and
    differs between processes (no two share a dropout or augmentation stream). The step counter is the
    source's.
    """
    source = state["torch_manual_seed"]
    raw = bytes(source.numpy().tobytes()) if isinstance(source, torch.Tensor) else bytes(source)
    seed = zlib.crc32(str(int(process_index)).encode(), zlib.crc32(raw))
    version, py_state, gauss = random.Random(seed).getstate()
    kind, keys, pos, has_gauss, cached = np.random.RandomState(seed).get_state()
    derived: dict[str, Any] = {
        "step": int(state.get("step", 0)),
        "format": "hasten-rng-1",
        "random_state": [int(version), [int(x) for x in py_state], gauss],
        "numpy_random_seed": [str(kind), torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss),
                              float(cached)],
        "torch_manual_seed": torch.Generator().manual_seed(seed).get_state(),
    }
    if "torch_cuda_manual_seed" in state and torch.cuda.is_available():
        derived["torch_cuda_manual_seed"] = [torch.Generator(device=f"cuda:{i}").manual_seed(seed + i).get_state()
                                             for i in range(len(state["torch_cuda_manual_seed"]))]
    elif "torch_cuda_manual_seed" in state:
        derived["torch_cuda_manual_seed"] = state["torch_cuda_manual_seed"]  # restore_rng_state names the problem
    return derived


def restore_rng_state(state: dict[str, Any], source: Path) -> int:
    """Restore what :func:`capture_rng_state` saved (or Accelerate's layout); returns the step counter.

    Raises:
        CheckpointError: a generator's state is missing or malformed.
    """
    try:
        py = state["random_state"]
        random.setstate((py[0], tuple(py[1]), py[2]) if isinstance(py, list) else py)
        numpy_state = state["numpy_random_seed"]
        if isinstance(numpy_state, list):
            kind, keys, pos, has_gauss, cached = numpy_state
            np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
        else:
            np.random.set_state(numpy_state)
        torch.set_rng_state(state["torch_manual_seed"])
        if "torch_cuda_manual_seed" in state:
            if not torch.cuda.is_available():
                raise CheckpointError(f"{source} holds CUDA generator states but CUDA is not available here")
            torch.cuda.set_rng_state_all(state["torch_cuda_manual_seed"])
        return int(state.get("step", 0))
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"Could not restore the random generators from {source}: {exc!r}. "
                              "The file is damaged or was written by an incompatible version.") from exc
