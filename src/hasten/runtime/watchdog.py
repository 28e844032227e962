"""Bounded hangs: a per-rank watchdog thread that turns a stuck collective into a report and an exit.

Every hasten collective records what it is doing (operation, shapes, call site, start time) in one
module-level slot, and the last few collectives in a ring: two assignments per call, no communication.
A daemon thread per rank watches that slot. When a rank has been inside one collective for longer than
the bound (default 5 minutes; ``InitProcessGroupKwargs(timeout=...)`` or ``hasten launch
--collective_timeout``), it raises a flag in the process group's own store (a ``clone()`` of torch's
default store, so the thread never waits behind the main thread's store calls). Every rank's watchdog
polls that flag, publishes its own view (what it is in, or which line of the script it is running, and
its last collectives), collects the others' views, prints them all, and ends the process with
:data:`HANG_EXIT_CODE`, so ``hasten launch``/torchrun stop the whole run. A rank whose process is gone
shows up as "no report".

The process group's own timeout is set a little beyond the bound (see :func:`process_group_timeout`),
so torch's own error remains the backstop for collectives hasten does not see (DDP's gradient
all-reduce, a user's direct ``torch.distributed`` call).

The thread lives and dies with the process group: :mod:`hasten.runtime.process_group` starts it
(``watch_run``) and stops it before the group's store goes away (``end_group``).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from collections import deque
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from hasten._private_api import clone_default_store
from hasten.runtime.debug_checks import describe, format_description, user_file, user_frame

DEFAULT_BOUND = timedelta(minutes=5)
#: Exit status of a rank stopped by the watchdog (as ``timeout(1)`` uses for "timed out").
HANG_EXIT_CODE = 124
_RECENT = 6
_FLAG = "hasten_watchdog/hang"
_VIEW = "hasten_watchdog/view/"
_DONE = "hasten_watchdog/printed"


class _Tracker:
    """What this rank is doing now (``current``) and did last (``recent``); written by the main thread.

    The call site is kept raw, as (code object, instruction offset) of the first frame in the user's
    code: turning it into ``file:line`` costs more than the rest of the bookkeeping, and only a report
    (rare) needs the text. A code object holds no locals, so nothing of the user's is kept alive.
    """

    def __init__(self) -> None:
        self.enabled = False
        # (name, describe(data) or None, raw call site, start); formatted only when a report is printed
        self.current: tuple[str, Any, Any, float] | None = None
        self.recent: deque[tuple[str, Any, Any]] = deque(maxlen=_RECENT)
        self.last_end = time.monotonic()

    def enter(self, name: str, data: Any = None) -> None:
        """Mark this rank as inside collective ``name`` (callers test ``enabled`` first)."""
        what = describe(data) if data is not None else None
        frame = user_frame(sys._getframe(1))
        site = (frame.f_code, frame.f_lasti) if frame is not None else None
        self.current = (name, what, site, time.monotonic())
        self.recent.append((name, what, site))

    def exit(self) -> None:
        """Mark the collective entered last as finished."""
        self.current = None
        self.last_end = time.monotonic()


#: This rank's tracker. Hot paths test ``TRACKER.enabled`` (True while a watchdog runs) and call
#: ``TRACKER.enter(name)`` / ``TRACKER.exit()`` themselves, which costs less than ``with tracked(name)``.
TRACKER = _Tracker()


def _site_text(site: Any) -> str:
    """``file:line in function`` for a raw site recorded by :meth:`_Tracker.enter`."""
    if site is None:
        return "<unknown>"
    code, offset = site
    line = next((number for start, end, number in code.co_lines() if start <= offset < end), None)
    return f"{user_file(code.co_filename)}:{line} in {code.co_name}"


class _Tracked:
    __slots__ = ("name", "data")

    def __init__(self, name: str, data: Any) -> None:
        self.name, self.data = name, data

    def __enter__(self) -> None:
        TRACKER.enter(self.name, self.data)

    def __exit__(self, *exc: Any) -> None:
        TRACKER.exit()


class _Untracked:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_UNTRACKED = _Untracked()


def tracked(name: str, data: Any = None) -> Any:
    """Context manager marking this rank as inside collective ``name`` (a no-op when no watchdog runs)."""
    return _Tracked(name, data) if TRACKER.enabled else _UNTRACKED


def _described(name: str, what: Any, site: Any) -> str:
    return f"`{name}` with {format_description(what) if what is not None else 'no tensors'} at {_site_text(site)}"


def process_group_timeout(bound: timedelta) -> timedelta:
    """The process group's timeout for a watchdog ``bound``: late enough for the watchdog's report first."""
    return bound + timedelta(seconds=15) + min(bound, timedelta(seconds=60))


class _Watchdog(threading.Thread):
    def __init__(self, store: Any, rank: int, world: int, bound: timedelta) -> None:
        super().__init__(name="hasten-watchdog", daemon=True)
        self.store, self.rank, self.world, self.bound = store, rank, world, bound.total_seconds()
        self.poll = min(5.0, max(0.1, self.bound / 20))
        self.collect = min(10.0, max(2.0, self.bound))
        self.stopped = threading.Event()
        self.main_ident = threading.main_thread().ident

    def run(self) -> None:
        while not self.stopped.wait(self.poll):
            try:
                self._tick()
            except Exception:  # noqa: BLE001 - the store is gone (run ending, or its host died): stop watching
                if self.stopped.is_set():
                    return
                current = TRACKER.current
                if current is not None and time.monotonic() - current[3] > self.bound:
                    self._finish(f"{self._first_line(self.rank)}\n  rank {self.rank}: {self._view()}\n"
                                 "  (the other ranks could not be asked: the process group's store is gone)")

    def _tick(self) -> None:
        current = TRACKER.current
        if current is not None and time.monotonic() - current[3] > self.bound:
            self.store.compare_set(_FLAG, "", str(self.rank))  # the first rank to notice is the one named
        if self.store.check([_FLAG]):
            self._report()

    def _view(self) -> str:
        current = TRACKER.current
        now = time.monotonic()
        if current is not None:
            name, what, site, start = current
            return f"in {_described(name, what, site)}, for {now - start:.1f} s"
        frame = sys._current_frames().get(self.main_ident) if self.main_ident is not None else None
        where = _user_line(frame)
        return (f"not in a hasten collective; running {where} ({now - TRACKER.last_end:.1f} s since its last "
                "collective ended)")

    def _first_line(self, noticed_by: int) -> str:
        return (f"hasten watchdog (rank {self.rank}): rank {noticed_by} waited in a collective for more than "
                f"{self.bound:g} s. What each rank was doing:")

    def _report(self) -> None:
        noticed_by = int(self.store.get(_FLAG).decode() or self.rank)
        mine = self._view()
        recent = [_described(*entry) for entry in TRACKER.recent]
        self.store.set(f"{_VIEW}{self.rank}", json.dumps({"now": mine, "recent": recent}))
        deadline = time.monotonic() + self.collect
        keys = [f"{_VIEW}{r}" for r in range(self.world)]
        while time.monotonic() < deadline and not self.store.check(keys):
            time.sleep(0.05)
        lines, histories, reporters = [self._first_line(noticed_by)], [], []
        for rank, key in enumerate(keys):
            if not self.store.check([key]):
                lines.append(f"  rank {rank}: no report within {self.collect:g} s (its process is gone or frozen)")
                continue
            reporters.append(rank)
            view = json.loads(self.store.get(key))
            lines.append(f"  rank {rank}: {view['now']}")
            if view["recent"]:
                histories.append(f"  rank {rank}'s last collectives:\n" + "\n".join(f"    {h}" for h in view["recent"]))
        if reporters and reporters[0] != self.rank:
            # One full report is enough (the lowest rank that answered prints it); the others say their part.
            lines = [f"hasten watchdog (rank {self.rank}): stopping the run; this rank was {mine} (rank "
                     f"{reporters[0]} prints every rank's state)."]
            histories = []
        hint = ("A collective must be called by every process, in the same order (not inside `if "
                "accelerator.is_main_process:`). If one rank legitimately works alone for longer (a large save, "
                "evaluation on the main process), raise the bound: InitProcessGroupKwargs(timeout=...) or "
                "`hasten launch --collective_timeout SECONDS`.")
        if len(lines) > 1:
            lines = [*lines, *histories, hint, f"Stopping every rank (exit code {HANG_EXIT_CODE})."]
        print("\n".join(lines), file=sys.stderr, flush=True)
        # Leave together: the first rank to exit makes the launcher stop the others, maybe before they printed,
        # and with c10d rank 0 hosts the store the others still read.
        self.store.add(_DONE, 1)
        while time.monotonic() < deadline + self.collect and self.store.add(_DONE, 0) < self.world:
            time.sleep(0.05)
        self._finish("")

    def _finish(self, text: str) -> None:
        if text:
            print(text, file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(HANG_EXIT_CODE)


_LIBRARY_DIRS = tuple(os.path.dirname(p) for p in (os.__file__, dist.__file__, __file__))


def _user_line(frame: Any) -> str:
    """``file:line in function`` of the innermost frame of ``frame``'s stack in the user's code."""
    if frame is None:
        return "<unknown>"
    stack = traceback.extract_stack(frame)
    torch_dir = os.path.dirname(_LIBRARY_DIRS[1])
    hasten_dir = os.path.dirname(_LIBRARY_DIRS[2])
    for entry in reversed(stack):
        name = os.path.abspath(entry.filename)
        if not name.startswith((_LIBRARY_DIRS[0], torch_dir, hasten_dir)) and not name.startswith("<"):
            return f"{entry.filename}:{entry.lineno} in {entry.name}"
    last = stack[-1] if stack else None
    return f"{last.filename}:{last.lineno} in {last.name}" if last else "<unknown>"


_RUNNING: dict[str, _Watchdog] = {}


def start_watchdog(bound: timedelta) -> bool:
    """Start this rank's watchdog on the default process group; True when it runs.

    Not started for one process or when the default store cannot be cloned for a second thread.
    """
    stop_watchdog()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return False
    store = clone_default_store()
    if store is None:  # a store without clone(): the process group's timeout still bounds hangs
        return False
    watchdog = _Watchdog(store, dist.get_rank(), dist.get_world_size(), bound)
    TRACKER.enabled = True
    TRACKER.recent.clear()
    _RUNNING["default"] = watchdog
    watchdog.start()
    return True


def running_bound() -> timedelta | None:
    """The bound of this rank's running watchdog (the run's collective bound), or ``None`` when none runs."""
    watchdog = _RUNNING.get("default")
    return None if watchdog is None else timedelta(seconds=watchdog.bound)


def stop_watchdog() -> None:
    """Stop this rank's watchdog (before the process group and its store go away)."""
    TRACKER.enabled = False
    TRACKER.current = None
    watchdog = _RUNNING.pop("default", None)
    if watchdog is not None:
        watchdog.stopped.set()
        watchdog.join(timeout=watchdog.poll + 1)
