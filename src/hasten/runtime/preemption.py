"""Graceful preemption: a signal makes every rank stop at the same optimizer step, save, and leave.

The protocol (no store round trip or collective on a normal step):

1. A signal handler in each worker only records the time and raises a flag, without a lock (``SIGTERM`` by default,
   ``hasten launch --preemption_signal USR1`` for SLURM's ``--signal=USR1@90``).
2. A daemon *watcher* thread per rank, with its own handle on the run's store, publishes the request
   (``hasten_preempt/<restart>/request``; the elastic restart count in the key, so a restarted worker
   group never reads a dead round's keys) and otherwise polls that key about once a second, so ranks
   that got no signal learn it too. On learning, the watcher sets :attr:`_Preemption.pending` *first*,
   then reads the main thread's count of optimizer steps ``c_r`` and posts it; once every rank posted,
   the stop step is ``S = max(c_r) + 1``.
3. The main thread counts optimizer steps (one increment) and reads ``pending`` (one attribute read)
   before and after each, and counts the Accelerator collectives it enters the same way (``calls``);
   only when ``pending`` is set does it wait for ``S``. Because ``pending`` is set before ``c_r``
   is read, a rank's main thread checks ``pending`` at every step after ``c_r``, so it cannot pass
   ``S >= c_r + 1`` unseen; and the posts come from the watchers, never from a main thread, so a main
   thread waiting for ``S`` (or blocked in a collective behind a waiting peer) cannot hold them up.
4. After optimizer step ``S`` every rank sets :attr:`_Preemption.requested`
   (``Accelerator.preemption_requested``) and the next *boundary* stops it: the prepared data loader's
   next batch when a loader pass is in progress at ``S`` (the loader position then excludes that batch),
   otherwise the next forward of a prepared model, the next optimizer step or the next Accelerator
   collective, whichever comes first. There, with automatic checkpoint naming, every rank saves the
   state, rank 0 logs one line, SLURM jobs are requeued, the group ends and the process exits with
   :data:`PREEMPTED_EXIT_CODE`; a loop that neither has automatic naming nor reads
   ``preemption_requested`` exits the same way with a line saying that no checkpoint was written.
5. Loops without optimizer steps (evaluation): when this rank has not stopped :data:`NO_STEP_SECONDS`
   after the decision, its watcher publishes ``.../idle``; every watcher then sets
   :attr:`_Preemption.calls_pending` first, reads its main thread's count of Accelerator collectives
   ``k_r`` and posts it, and ``C = max(k_r) + 1``. Every rank stops *before* entering its collective
   ``C`` (so no rank waits in it for one that stopped), unless step ``S`` came first. Both counts run
   along the same sequence of steps and collectives on every rank, so "whichever comes first" is the
   same point everywhere, and ``C`` is beyond every rank's position when it is decided.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Any

#: Exit status of a worker (and of ``hasten launch``) stopped by preemption after its checkpoint
#: (``EX_TEMPFAIL`` of sysexits.h: try again later, e.g. requeue and resume).
PREEMPTED_EXIT_CODE = 75
#: How often a watcher asks the store whether another rank was signalled (off the step path).
POLL_SECONDS = 1.0
#: How long a rank waits for every rank's step count before it gives up stopping (a rank is gone).
DECIDE_TIMEOUT = timedelta(seconds=60)
#: A rank not stopped this long after the stop step was decided (evaluation, a loop without optimizer
#: steps) makes every rank agree on a collective to stop at instead (step 5 above).
NO_STEP_SECONDS = 5.0
_KEY = "hasten_preempt"

logger = logging.getLogger("hasten.preemption")


class Preempted(SystemExit):
    """Raised at the stop boundary after the checkpoint: ends the worker with :data:`PREEMPTED_EXIT_CODE`."""


class _Preemption:
    """This process's preemption state. ``steps``/``calls``/``pending``/``save_due`` are the hot-path fields."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget any request (tests, ``reset_state``); the signal handler is left in place."""
        self.pending = False  # the one flag read at every optimizer step and collective
        self.requested = False  # True from the stop point on (Accelerator.preemption_requested)
        self.acknowledged = False  # the script read `preemption_requested` at least once
        self.save_due = False  # a boundary is due: the loader's next batch, or (outside_loader) the next call
        self.outside_loader = False  # no loader pass was in progress at the stop: forward/step/collective stop
        self.done = False  # this rank reached its boundary (at_boundary ran)
        self.holding = 0  # inside save_state/load_state/save_model or at_boundary: no boundary there
        self.steps = 0  # optimizer steps done by the main thread
        self.calls = 0  # Accelerator collectives entered by the main thread
        self.stop_step: int | None = None
        self.calls_pending = False  # the watchers agree on a collective to stop at (no step came)
        self.stop_call: int | None = None
        self.stop_note = ""  # how the stop point was found, for the log line
        self.signal_name: str | None = None
        self.signal_time: float | None = None  # time.time() when this rank got the signal or learned of it
        self.signalled = False  # set by the signal handler (with a byte to the wake-up pipe, never a lock)
        self.decided = threading.Event()  # set by the watcher once stop_step is known
        self.calls_decided = threading.Event()  # set by the watcher once stop_call is known
        self.stop_action: Callable[[], Any] | None = None
        self.in_loader: Callable[[], bool] | None = None  # a prepared data loader pass is in progress
        self.watch_forwards: Callable[[], list[Any]] | None = None  # forward pre-hooks on the models (handles)
        self.hooks: list[Any] = []
        self.end_group: Callable[[], None] | None = None
        self.exit_code = PREEMPTED_EXIT_CODE
        self.marker_dir: str | None = None
        self.rank = 0  # this process's rank in the run (set by arm)

    # -------------------------------------------------------------------------- main thread, step path
    def after_step(self) -> None:
        """Called after an optimizer step while ``pending``: wait for ``S``; at ``S`` raise the flags."""
        if self.stop_step is None and not self.decided.wait(DECIDE_TIMEOUT.total_seconds()):
            logger.warning("hasten: preemption requested but not every rank posted its step within %.0f s; "
                           "training goes on (a rank may be gone)", DECIDE_TIMEOUT.total_seconds())
            self.pending = False
            return
        if self.stop_step is not None and self.steps >= self.stop_step and not self.requested:
            self._stop_here()

    def before_step(self) -> None:
        """Called before an optimizer step while ``pending``: the boundary after ``S`` outside a loader."""
        if self.save_due and self.outside_loader and not self.holding:
            self.at_boundary()

    def before_call(self, name: str) -> None:
        """Count an Accelerator collective (``name``) about to start; stop before it when it is a boundary."""
        self.calls += 1
        if not self.pending or self.holding or self.done:
            return
        if self.save_due and self.outside_loader:
            self.at_boundary()
            return
        if not self.calls_pending:
            return
        if self.stop_call is None and not self.calls_decided.wait(DECIDE_TIMEOUT.total_seconds()):
            logger.warning("hasten: preemption requested but not every rank posted its collective count within "
                           "%.0f s; the run goes on (a rank may be gone)", DECIDE_TIMEOUT.total_seconds())
            self.calls_pending = False
            return
        if self.stop_call is None or self.calls < self.stop_call:
            return
        self.calls_pending = False
        if not self.requested:
            self.stop_note = (f", at the same {name} call (no optimizer step came within {NO_STEP_SECONDS:g} s "
                              "of the decision)")
            self._stop_here()
        elif self.save_due and not (self.in_loader is not None and self.in_loader()):
            self.outside_loader = True  # stopped at S, then no batch came: this call is the boundary
        if self.save_due and self.outside_loader:
            self.at_boundary()

    def before_forward(self) -> None:
        """A prepared model's forward pre-hook, installed only once a boundary is due outside a loader."""
        if self.save_due and self.outside_loader and not self.holding:
            self.at_boundary()

    def _stop_here(self) -> None:
        """Every rank is at the stop point: raise the flags and choose where the boundary is."""
        self.requested = True
        self.save_due = True
        self.outside_loader = not (self.in_loader is not None and self.in_loader())
        if self.outside_loader and self.watch_forwards is not None:
            self.hooks = self.watch_forwards()
        if self.marker_dir and self.acknowledged:  # a loop that saves by itself: hasten launch reports the stop
            _write_marker(self.marker_dir, self.rank, "(saved by the script)")

    def at_boundary(self) -> None:
        """At the boundary (a prepared loader's next batch, or the next call outside one): checkpoint and exit.

        Without automatic checkpoint naming the user's loop decides (``preemption_requested``); a loop
        that never asked ends here with :data:`PREEMPTED_EXIT_CODE` and a line saying so, with no checkpoint.
        """
        self.save_due = False
        self.done = True
        self.holding += 1  # the save's own collectives are no boundary
        try:
            for handle in self.hooks:
                handle.remove()
            self.hooks = []
            action = self.stop_action
            target = action() if action is not None else None
            if target is not None:
                finish(target, rank=self.rank)
            if not self.acknowledged:
                finish(None, rank=self.rank)
        finally:
            self.holding -= 1

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """No boundary inside this block (a save or load in progress: a checkpoint must not nest in it)."""
        self.holding += 1
        try:
            yield
        finally:
            self.holding -= 1


PREEMPTION = _Preemption()


def stop_point() -> str:
    """Where every rank stopped, for the log lines (``after optimizer step 12``)."""
    where = f"after optimizer step {PREEMPTION.steps}" if PREEMPTION.steps else "before any optimizer step"
    return where + PREEMPTION.stop_note


def finish(target: Any, *, rank: int) -> None:
    """After the stop point: log, mark, requeue (SLURM, when a checkpoint was saved), end the group, exit.

    ``target`` is the checkpoint saved, or None when none could be (the line then says so).

    Raises:
        Preempted: always, with the worker's exit code.
    """
    from hasten.environments.slurm import requeue_job

    state = PREEMPTION
    took = time.time() - (state.signal_time or time.time())
    if rank == 0:
        if target is None:
            print(f"hasten: preempted by {state.signal_name or 'a signal'}: every rank stopped {stop_point()}, "
                  f"{took:.1f} s after the signal; no checkpoint was written (the script has no automatic checkpoint "
                  "naming and never reads accelerator.preemption_requested)", flush=True)
        else:
            print(f"hasten: preempted by {state.signal_name or 'a signal'}: every rank stopped {stop_point()}; "
                  f"checkpoint {target} saved {took:.1f} s after the signal", flush=True)
    if state.marker_dir:  # hasten launch's agent turns these into its own exit status
        _write_marker(state.marker_dir, rank, "" if target is None else target)
    if rank == 0 and target is not None:  # without a checkpoint a requeued job would only start over
        message = requeue_job(os.environ)
        if message:
            print(f"hasten: {message}", flush=True)
    if state.end_group is not None:  # the process group's owner ends it (no barrier: every rank is here)
        state.end_group()
    raise Preempted(state.exit_code)


def _write_marker(folder: str, rank: int, target: Any) -> None:
    """``rank<r>`` in ``folder``: three lines, the signal's time, where the ranks stopped, the checkpoint."""
    path = os.path.join(folder, f"rank{rank}")
    try:
        with open(path + ".tmp", "w") as f:
            f.write(f"{PREEMPTION.signal_time or time.time()}\n{stop_point()}\n{target}\n")
        os.replace(path + ".tmp", path)
    except OSError as exc:
        logger.warning("hasten: cannot write the preemption marker %s: %s", path, exc)


# ------------------------------------------------------------------------------------------ watcher
class _Watcher(threading.Thread):
    """Publishes this rank's signal, learns the others', posts this rank's step count, computes ``S``."""

    def __init__(self, store: Any, rank: int, world: int, generation: str) -> None:
        super().__init__(name="hasten-preemption", daemon=True)
        self.store, self.rank, self.world = store, rank, world
        self.prefix = f"{_KEY}/{generation}"
        self.stopped = threading.Event()

    def run(self) -> None:
        state = PREEMPTION
        try:
            if not self._learn(state):
                return
            self._decide(state)
            if self._no_stop_in_time(state):
                self._decide_call(state)
        except Exception as exc:  # noqa: BLE001 - the store is gone (run ending): nothing left to coordinate
            if not self.stopped.is_set():
                logger.debug("hasten: preemption watcher stopped: %s", exc)

    def _learn(self, state: _Preemption) -> bool:
        """Wait for this rank's signal (then publish it) or another rank's; False when stopped first."""
        while not self.stopped.is_set():
            if _wait_for_signal(state, POLL_SECONDS):
                if self.store is not None:
                    self.store.set(f"{self.prefix}/request", f"{self.rank} {state.signal_name}")
                return True
            if self.store is not None and self.store.check([f"{self.prefix}/request"]):
                who, _, name = self.store.get(f"{self.prefix}/request").decode().partition(" ")
                state.signal_name = state.signal_name or f"{name} (on rank {who})"
                state.signal_time = state.signal_time or time.time()
                return True
        return False

    def _agree_on_next(self, counter: str, mine: int) -> int:
        """One more than the furthest process's ``counter`` (steps or collectives): where every process stops."""
        if self.store is None:
            return mine + 1
        self.store.set(f"{self.prefix}/{counter}/{self.rank}", str(mine))
        keys = [f"{self.prefix}/{counter}/{r}" for r in range(self.world)]
        self.store.wait(keys, DECIDE_TIMEOUT)
        return max(int(self.store.get(k)) for k in keys) + 1

    def _decide(self, state: _Preemption) -> None:
        state.pending = True  # first: from here on the main thread checks after every step
        state.stop_step = self._agree_on_next("step", state.steps)
        state.decided.set()

    def _no_stop_in_time(self, state: _Preemption) -> bool:
        """True once some rank was not stopped :data:`NO_STEP_SECONDS` after the decision (``.../idle``).

        A rank that stopped (or whose loop was told and reads ``preemption_requested``) does not start
        that round, but keeps answering: the others may still need its count of collectives.
        """
        key = f"{self.prefix}/idle"
        deadline = time.monotonic() + NO_STEP_SECONDS
        while not self.stopped.is_set():
            if self.store is not None and self.store.check([key]):
                return True
            left = deadline - time.monotonic()
            if left <= 0 and not state.done and not (state.requested and state.acknowledged):  # else the loop decides
                if self.store is not None:
                    self.store.set(key, str(self.rank))
                return True
            self.stopped.wait(POLL_SECONDS if left <= 0 else min(POLL_SECONDS, left))
        return False

    def _decide_call(self, state: _Preemption) -> None:
        state.calls_pending = True  # first: from here on the main thread checks before every collective
        state.stop_call = self._agree_on_next("calls", state.calls)
        state.calls_decided.set()


_RUNNING: dict[str, Any] = {"watcher": None, "handled": None}


_WAKE: dict[str, Any] = {"pid": None, "fds": (-1, -1)}


def _wake_pipe() -> tuple[int, int]:
    """This process's wake-up pipe (read, write), both non-blocking; made again in a forked child."""
    if _WAKE["pid"] != os.getpid():  # a forked rank must not share its parent's (or siblings') pipe
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        _WAKE.update(pid=os.getpid(), fds=(read, write))
    return _WAKE["fds"]


def _wait_for_signal(state: _Preemption, timeout: float) -> bool:
    """Block the watcher until the handler ran or ``timeout`` passed; True once signalled."""
    if not state.signalled:
        read = _wake_pipe()[0]
        waiter = select.poll()  # not select.select(): it refuses descriptors above 1023 (busy processes have them)
        waiter.register(read, select.POLLIN)
        waiter.poll(timeout * 1000)
        try:
            while os.read(read, 64):
                pass
        except BlockingIOError:
            pass
    return state.signalled


def _on_signal(signum: int, frame: Any) -> None:
    # Only records, and takes no lock: the handler runs on the main thread between two bytecodes and can
    # run again inside itself (under SLURM the launcher and the worker both get the signal and the launcher
    # forwards it, so the worker gets it twice). threading.Event.set() takes a lock, and a second signal
    # inside it deadlocked the main thread. The watcher thread does the rest (store, group).
    state = PREEMPTION
    if state.signal_time is None:
        state.signal_time = time.time()
        state.signal_name = signal.Signals(signum).name
    state.signalled = True
    try:
        os.write(_WAKE["fds"][1], b"!")
    except OSError:  # pipe full (the watcher is already awake) or not made: the flag is set either way
        pass


def signal_number(name: str | None) -> signal.Signals:
    """The signal named ``name`` (``"USR1"``, ``"SIGUSR1"`` or ``"10"``); SIGTERM for None.

    Raises:
        ValueError: no such signal.
    """
    if not name:
        return signal.SIGTERM
    text = str(name).strip().upper()
    try:
        return signal.Signals(int(text)) if text.isdigit() else signal.Signals[text if text.startswith("SIG")
                                                                              else "SIG" + text]
    except (KeyError, ValueError):
        raise ValueError(f"preemption_signal={name!r} is not a signal name; use e.g. TERM or USR1.") from None


def arm(*, store: Any, rank: int, world: int, signal_name: str | None, env: Mapping[str, str],
        stop_action: Callable[[], Any] | None, marker_dir: str | None,
        end_group: Callable[[], None] | None = None, in_loader: Callable[[], bool] | None = None,
        watch_forwards: Callable[[], list[Any]] | None = None) -> bool:
    """Install the signal handler and start this rank's watcher (once per run); True when armed now.

    ``store`` is a handle for the watcher's thread alone (None with one process), ``stop_action``
    saves the automatic checkpoint and returns its folder (or None when the run has none),
    ``marker_dir`` is where ``hasten launch`` looks for the workers that stopped (None outside it),
    ``end_group`` ends the process group before the process exits, ``in_loader`` tells whether a
    prepared data loader pass is in progress, and ``watch_forwards`` puts a forward pre-hook calling
    :meth:`_Preemption.before_forward` on the prepared models and returns the handles.
    """
    state = PREEMPTION
    state.stop_action = stop_action
    state.in_loader = in_loader
    state.watch_forwards = watch_forwards
    state.end_group = end_group
    state.marker_dir = marker_dir
    state.rank = rank
    state.exit_code = 0 if marker_dir else PREEMPTED_EXIT_CODE  # hasten launch's agent must not restart them
    if _RUNNING["watcher"] is not None:
        return False
    if threading.current_thread() is not threading.main_thread():
        return False  # signal handlers can only be installed from the main thread
    sig = signal_number(signal_name)
    _wake_pipe()  # before the handler can run: it only writes to the pipe
    _RUNNING["handled"] = (sig, signal.signal(sig, _on_signal))
    generation = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    watcher = _Watcher(store, rank, world, generation)
    _RUNNING["watcher"] = watcher
    watcher.start()
    return True


def disarm() -> None:
    """Stop the watcher (before the store goes away) and put the previous signal handler back."""
    watcher, _RUNNING["watcher"] = _RUNNING["watcher"], None
    if watcher is not None:
        watcher.stopped.set()
    handled, _RUNNING["handled"] = _RUNNING["handled"], None
    if handled is not None and threading.current_thread() is threading.main_thread():
        signal.signal(handled[0], handled[1])


__all__ = ["NO_STEP_SECONDS", "PREEMPTED_EXIT_CODE", "PREEMPTION", "Preempted", "arm", "disarm", "finish",
           "signal_number", "stop_point"]
