"""Run a function on N gloo ranks forked from this process: the multi-rank test harness.

Ranks meet at a ``FileStore`` in a temporary folder (no ports), every rank's traceback is kept, and a
short process-group timeout plus an overall deadline bound hangs. Each rank ends with a barrier and
``destroy_process_group`` (gloo otherwise aborts some processes at exit).
"""

from __future__ import annotations

import datetime
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hasten.config.env import test_start_method
from hasten.runtime.process_group import end_group, group_running, start_group


class RankFailed(RuntimeError):
    """One or more ranks raised (or the run timed out); the message holds every rank's traceback."""


def _rank_main(rank: int, world_size: int, tmp_dir: str, fn: Callable[..., Any], args: tuple[Any, ...],
               pg_timeout: float, env: dict[str, str]) -> None:
    # Forked ranks are gloo/CPU ranks unless the caller's env says otherwise (ACCELERATE_USE_CPU=false, in a
    # parent that has not touched CUDA): CUDA cannot be re-initialised in a forked child.
    os.environ["ACCELERATE_USE_CPU"] = "true"
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")  # never used: the FileStore is the rendezvous
    torch.set_num_threads(1)  # several ranks on 2 cores: no oversubscription
    from hasten.state import reset_state

    reset_state()  # a forked child must not inherit the parent's view of the run
    store = dist.FileStore(os.path.join(tmp_dir, "rdzv_store"), world_size)
    start_group(backend="gloo", store=store, rank=rank, world_size=world_size,
                timeout=datetime.timedelta(seconds=pg_timeout))
    ok = False
    try:
        result = fn(*args)
        with open(os.path.join(tmp_dir, f"rank{rank}.result"), "wb") as f:
            pickle.dump(result, f)
        ok = True
    except BaseException:
        with open(os.path.join(tmp_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if group_running():
            try:
                end_group(barrier=ok)
            except RuntimeError:
                pass  # a failed barrier: the group is destroyed all the same, the rank's own error is kept
        reset_state()


def run_on_ranks(fn: Callable[..., Any], world_size: int = 2, args: tuple[Any, ...] = (),
                 tmp_dir: str | os.PathLike[str] | None = None, timeout: float = 120.0, pg_timeout: float = 60.0,
                 env: dict[str, str] | None = None, start_method: str | None = None) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks and return each rank's (picklable) result.

    Args:
        fn: the rank body; inside it ``torch.distributed`` is initialised and ``PartialState()`` works.
        world_size: number of ranks.
        args: positional arguments for ``fn``.
        tmp_dir: folder for the rendezvous file and reports (a fresh temporary one by default).
        timeout: seconds before the whole run is killed.
        pg_timeout: the process group's timeout, which bounds a collective some rank never joins.
        env: extra environment variables set in every rank before ``fn`` runs (``ACCELERATE_USE_CPU`` is
            ``true`` unless given here).
        start_method: ``fork`` (default) or ``spawn`` (``fn`` must then be importable).

    Example:
        >>> def body():
        ...     return torch.distributed.get_rank()
        >>> run_on_ranks(body, world_size=2)
        [0, 1]

    Raises:
        RankFailed: a rank raised or the run exceeded ``timeout``; the message has every rank's traceback.
    """
    if tmp_dir is None:
        with tempfile.TemporaryDirectory(prefix="hasten-ranks-") as fresh:
            return run_on_ranks(fn, world_size, args, fresh, timeout, pg_timeout, env, start_method)
    tmp = Path(tmp_dir)
    tmp.mkdir(parents=True, exist_ok=True)
    method = start_method or test_start_method()
    if start_method is None and method == "fork" and torch.cuda.is_initialized():
        # After CUDA work in this process autograd runs device threads, and a forked child cannot run
        # backward ("autograd's threading in combination with fork"): start the ranks fresh instead.
        method = "spawn"
    context = mp.start_processes(_rank_main, args=(world_size, str(tmp), fn, args, pg_timeout, dict(env or {})),
                                 nprocs=world_size, join=False, start_method=method)
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(0.05, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                raise RankFailed(f"ranks did not finish within {timeout:.0f} s\n" + _reports(tmp, world_size))
    except RankFailed:
        raise
    except Exception as exc:
        raise RankFailed(_reports(tmp, world_size) or str(exc)) from exc
    results = []
    for rank in range(world_size):
        with open(tmp / f"rank{rank}.result", "rb") as f:
            results.append(pickle.load(f))
    return results


def preload_deepspeed() -> None:
    """Import DeepSpeed (its "cpu" accelerator) and what its engine imports on first use, in this process.

    Ranks forked from it by :func:`run_on_ranks` then start with them loaded: building an engine imports
    DeepSpeed's Muon optimizer for its optimizer check, and with it ``torch._dynamo`` (about 10 s of every
    rank's start on two busy cores otherwise). Modules another DeepSpeed version lacks are skipped.

    Raises:
        MissingDependencyError: deepspeed is not installed.
    """
    import importlib

    from hasten.base.deepspeed_runtime import import_deepspeed

    import_deepspeed("cpu")
    for module in ("torch._dynamo", "deepspeed.runtime.zero.muon.muon_optimizer"):
        try:
            importlib.import_module(module)
        except ImportError:
            pass


def _reports(tmp: Path, world_size: int) -> str:
    parts = []
    for rank in range(world_size):
        path = tmp / f"rank{rank}.err"
        if path.exists():
            parts.append(f"--- rank {rank} ---\n{path.read_text()}")
    return "\n".join(parts)
