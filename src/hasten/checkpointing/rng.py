"""Every random generator's state in a form ``torch.load(weights_only=True)`` accepts.

Accelerate pickles NumPy's state object, which PyTorch >= 2.6 refuses to load with ``weights_only`` and
whose failure Accelerate then swallows. hasten stores plain ints, lists and tensors, and a state that
cannot be restored is an error.
"""

from __future__ import annotations

import random
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
