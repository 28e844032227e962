"""Debug mode: before each collective the ranks compare what they are about to do.

Off by default and then free (one boolean test). When on, every collective first meets at a
``monitored_barrier`` on a gloo group (it names the ranks that never arrive, instead of hanging), then
all ranks exchange the operation's name and tensor shapes; any difference raises
:class:`DistributedOperationError` on every rank with each rank's view.

The switch and the gloo group are process-wide state tied to the process group's lifetime, so they
live here beside :mod:`hasten.runtime.process_group`, which turns them on and off
(``set_debug_checks``, ``end_group``); the collectives of :mod:`hasten.ops` only call
:func:`verify_operation`.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hasten.exceptions import DistributedOperationError


@dataclass
class _DebugConfig:
    enabled: bool = False
    group: Any = None
    timeout: timedelta = timedelta(minutes=5)
    counter: int = 0
    # The last collectives this rank entered (the "hang doctor" prints them when ranks disagree).
    recent: deque[str] = field(default_factory=lambda: deque(maxlen=RECENT_COLLECTIVES))


RECENT_COLLECTIVES = 6
_CONFIG = _DebugConfig()
_HASTEN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


@functools.lru_cache(maxsize=4096)
def user_file(filename: str) -> str | None:
    """The absolute path of ``filename`` if it is user code (not hasten, torch or contextlib), else None."""
    path = os.path.abspath(filename)
    return None if path.startswith((_HASTEN_DIR, _TORCH_DIR)) or "contextlib" in path else path


def user_frame(frame: Any) -> Any:
    """The first frame from ``frame`` outwards that is the user's code (not hasten, torch or contextlib), or None."""
    while frame is not None and user_file(frame.f_code.co_filename) is None:
        frame = frame.f_back
    return frame


def call_site() -> str:
    """``file:line in function`` of the first frame outside hasten and torch: the user's code."""
    frame = user_frame(sys._getframe(1))
    if frame is None:
        return "<unknown>"
    return f"{user_file(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


def enable_debug_checks(group: Any, timeout: timedelta) -> None:
    """Turn the checks on; ``group`` is a gloo process group (None = the default group)."""
    _CONFIG.enabled = True
    _CONFIG.group = group
    _CONFIG.timeout = timeout
    _CONFIG.counter = 0
    _CONFIG.recent.clear()


def disable_debug_checks() -> None:
    """Turn the checks off."""
    _CONFIG.enabled = False
    _CONFIG.group = None
    _CONFIG.counter = 0


def debug_checks_enabled() -> bool:
    """True when collectives are checked across ranks."""
    return _CONFIG.enabled


def describe(data: Any) -> Any:
    """A picklable summary of a (nested) tensor structure: shapes, dtypes, and the type of other leaves."""
    if isinstance(data, torch.Tensor):
        return ("tensor", tuple(data.shape), str(data.dtype).replace("torch.", ""))
    if isinstance(data, (list, tuple)):
        return [describe(x) for x in data]
    if isinstance(data, dict):
        return {k: describe(v) for k, v in data.items()}
    return type(data).__name__


def format_description(desc: Any) -> str:
    """Readable text for a :func:`describe` result, e.g. ``shape (2, 3) float32``."""
    return _format(desc)


def _format(desc: Any) -> str:
    if isinstance(desc, tuple) and len(desc) == 3 and desc[0] == "tensor":
        return f"shape {desc[1]} {desc[2]}"
    if isinstance(desc, list):
        return "[" + ", ".join(_format(d) for d in desc) + "]"
    if isinstance(desc, dict):
        return "{" + ", ".join(f"{k!r}: {_format(v)}" for k, v in desc.items()) + "}"
    return str(desc)


def verify_operation(name: str, data: Any = None, *, same_shapes: bool = True,
                     same_ndim_only: bool = False) -> None:
    """Check that every rank is entering the same collective with compatible inputs.

    Args:
        name: the operation (``"gather"``, ``"broadcast"``, ...).
        data: its input; shapes must match on all ranks when ``same_shapes``.
        same_shapes: compare full shapes (gather needs equal shapes).
        same_ndim_only: compare only the number of dimensions (pad_across_processes).

    Raises:
        DistributedOperationError: a rank did not arrive within the timeout, or ranks disagree.
    """
    if not _CONFIG.enabled or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    _CONFIG.counter += 1
    seq = _CONFIG.counter
    rank = dist.get_rank()
    site = call_site()
    desc = describe(data)
    if same_ndim_only:
        desc = _ndims(desc)
    history = list(_CONFIG.recent)
    _CONFIG.recent.append(f"#{seq} `{name}` with {_format(desc)} at {site}")
    try:
        dist.monitored_barrier(group=_CONFIG.group, timeout=_CONFIG.timeout, wait_all_ranks=True)
    except RuntimeError as exc:
        match = re.search(r"Ranks? ([\d, ]+) failed", str(exc))
        missing = f"rank(s) {match.group(1).strip()}" if match else "some ranks"
        raise DistributedOperationError(
            f"debug mode: rank {rank} reached collective #{seq} `{name}` at {site} but {missing} did not arrive "
            f"within {_CONFIG.timeout} ({exc}). A collective must be called by every process (for example not "
            "inside `if accelerator.is_main_process:`)." + _history_lines(rank, history)) from exc
    mine = (name, seq, desc if (same_shapes or same_ndim_only) else None)
    views: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(views, (mine, site, history), group=_CONFIG.group)
    if any(v[0] != views[0][0] for v in views):
        lines = "\n".join(f"  rank {r}: collective #{v[0][1]} `{v[0][0]}` with {_format(v[0][2])} at {v[1]}"
                          for r, v in enumerate(views))
        raise DistributedOperationError(
            f"debug mode: ranks disagree on collective #{seq} (seen from rank {rank}):\n{lines}\n"
            "Every rank must call the same collectives in the same order, with equal shapes "
            "(use `pad_across_processes` before `gather` for tensors of different lengths)."
            + "".join(_history_lines(r, v[2]) for r, v in enumerate(views)))


def _history_lines(rank: int, history: list[str]) -> str:
    if not history:
        return ""
    return f"\n  rank {rank}'s previous collectives:\n" + "\n".join(f"    {h}" for h in history)


def _ndims(desc: Any) -> Any:
    if isinstance(desc, tuple) and len(desc) == 3 and desc[0] == "tensor":
        return ("tensor", (f"{len(desc[1])} dims",), desc[2])
    if isinstance(desc, list):
        return [_ndims(d) for d in desc]
    if isinstance(desc, dict):
        return {k: _ndims(v) for k, v in desc.items()}
    return desc
