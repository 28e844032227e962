"""Machine 0 of a ``--num_machines MIN:MAX`` launch hears the machines that cannot reach its rendezvous port.

With a fixed machine count, machine 0's network check waits for every machine in its own store and
reads their UDP reports meanwhile (:mod:`hasten.launchers.machines.check`). With MIN:MAX machines come and go,
so the check does not wait for the others: torch's c10d rendezvous does, in the agent, and completes
once MIN machines joined (MAX at once, or MIN and then ``last_call_timeout``). A machine whose TCP
connection to the rendezvous port is dropped or rejected still stops at once with its own line and
reports it over UDP (same address, same port number); this watch, a thread of machine 0's launcher,
reads those reports for the whole launch and decides what a user of an elastic run expects:

- **While fewer than MIN machines could still join, stop every machine.** Before the first round,
  each blocked machine is one fewer of the MAX that may join; when MAX minus the blocked ones drops
  below MIN, the rendezvous can never complete (a blocked machine already stopped), so waiting for the
  join timeout would only hide the cause. Machine 0 records its one line in its store, closes the
  rendezvous (:func:`hasten.launchers.machines.membership.close_rendezvous`): every agent waiting in it stops
  within about a second, reads the line (:func:`recorded_problem`) and prints it, like a fixed count.
- **Otherwise, name the blocked machine in one line and go on.** The run may still start with MIN or
  more machines, which is what MIN:MAX is for (a missing machine is tolerated, not fatal), so machine 0
  prints ``network check: ... the run goes on without it`` and keeps waiting. After the first round the
  run has at least MIN machines, and a late machine that cannot reach the port is only named.

If UDP is blocked as well, no report arrives, and machine 0 waits for torch's join timeout; its message
then names that as the likely cause (:func:`timeout_problem`).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from types import TracebackType

from hasten.launchers.machines import membership
from hasten.launchers.machines.check import reported_problem
from hasten.launchers.machines.reports import Inbox, Report
from hasten.launchers.machines.store import store_client

__all__ = ["ElasticWatch", "recorded_problem", "timeout_problem"]

_ABORT = "hasten/network_check/elastic_abort"  # the line, in machine 0's store (torch's rendezvous store)
_STOPPED = "hasten/network_check/elastic_stopped"  # machines that read it
_JOINED = "hasten/network_check/elastic_joined"  # machines other than 0 that passed their check
#: Seconds machine 0 keeps its store after closing the rendezvous, for the other machines to read the line.
LINGER = 5.0
_WAIT = 0.2  # how long the thread waits for a datagram before it looks at its stop flag


class ElasticWatch:
    """Machine 0's listener for the others' UDP reports under ``--num_machines MIN:MAX`` (see the module).

    A context manager: the thread runs inside it. ``fatal`` holds the one line once the machines stop.
    """

    def __init__(self, bind_addr: str, master_addr: str, port: int, min_nnodes: int, max_nnodes: int) -> None:
        self.master_addr, self.port, self.min_nnodes, self.max_nnodes = master_addr, port, min_nnodes, max_nnodes
        self.inbox = Inbox(bind_addr, port, max_nnodes)
        self.blocked: dict[tuple[int, str, str], str] = {}  # (rank, host, address) -> machine 0's line for it
        self.fatal: str | None = None
        self.others = 0  # machines in the rendezvous when it was closed (they read the line)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="hasten-network-watch", daemon=True)

    def __enter__(self) -> ElasticWatch:
        if self.inbox.sock is not None:  # the UDP port is taken: no reports, torch's timeouts as before
            self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self.inbox.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            report = self.inbox.wait(_WAIT)
            if report is not None:
                with contextlib.suppress(Exception):  # a log line must never end the launch
                    self.heard(report)

    def heard(self, report: Report) -> None:
        """Decide about one machine's report: stop every machine, or name it and go on."""
        key = (report.rank, report.host, report.address)
        if key in self.blocked or self.fatal is not None:
            return  # each report comes twice (UDP may lose one)
        line = reported_problem(report, self.master_addr, self.port)
        self.blocked[key] = line
        can_join = self.max_nnodes - len(self.blocked)
        machines = f"--num_machines {self.min_nnodes}:{self.max_nnodes}"
        if membership.rounds_met() == 0 and can_join < self.min_nnodes:
            self.fatal = (f"{line}. With {machines} at most {can_join} machine(s) can join now, fewer than "
                          f"{self.min_nnodes}: every machine stops")
            self._abort(self.fatal)
            return
        rest = (f"at most {can_join} of {self.max_nnodes} machines can join the first round, which needs "
                f"{self.min_nnodes}" if membership.rounds_met() == 0 else "the machines that joined train on")
        print(f"hasten launch: network check: {line}. The run goes on without it ({machines}: {rest})",
              file=sys.stderr, flush=True)

    def _abort(self, line: str) -> None:
        """Record ``line`` in machine 0's store, then close the rendezvous: every agent stops."""
        with contextlib.suppress(RuntimeError, OSError):  # no store: the others stop with torch's message
            store = store_client(self.master_addr, self.port, 5.0)
            store.set(_ABORT, line)
            self.others = int(store.add(_JOINED, 0))
        membership.close_rendezvous()

    def linger(self) -> None:
        """After ``fatal``: keep machine 0's store until the machines that joined read the line (LINGER at most)."""
        with contextlib.suppress(RuntimeError, OSError):
            store = store_client(self.master_addr, self.port, 5.0)
            deadline = time.monotonic() + LINGER
            while int(store.add(_STOPPED, 0)) < self.others and time.monotonic() < deadline:
                time.sleep(0.05)

    def timeout_problem(self, endpoint: str, error: BaseException) -> str:
        """Machine 0's line when torch's rendezvous timed out: what it heard, or the likely cause."""
        return timeout_problem(endpoint, self.port, self.min_nnodes, self.max_nnodes, error, list(self.blocked.values()))


def joined(master_addr: str, port: int) -> None:
    """A machine other than 0 passed its check under MIN:MAX: count it, so that machine 0 lingers for it."""
    with contextlib.suppress(RuntimeError, OSError):
        store_client(master_addr, port, 5.0).add(_JOINED, 1)


def recorded_problem(master_addr: str, port: int) -> str | None:
    """The line machine 0 recorded when it closed the rendezvous (see the module), or None."""
    with contextlib.suppress(RuntimeError, OSError):
        store = store_client(master_addr, port, 3.0)
        if store.check([_ABORT]):
            line = store.get(_ABORT).decode()
            store.add(_STOPPED, 1)
            return str(line)
    return None


def timeout_problem(endpoint: str, port: int, min_nnodes: int | None, max_nnodes: int, error: BaseException,
                    heard: list[str] | None = None) -> str:
    """The line for a rendezvous that timed out before enough machines joined (``error`` is torch's).

    With ``heard`` (machine 0's lines for the machines that reported), those are named; otherwise the
    likely causes are, including the one the UDP reports cannot cover: UDP blocked too.
    """
    wanted = f"{min_nnodes} of up to {max_nnodes}" if min_nnodes else str(max_nnodes)
    why = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    head = f"the machines could not meet at {endpoint}: fewer than {wanted} machines joined the rendezvous before its " \
           f"timeout ({why})."
    if heard:
        return f"{head} {' '.join(heard)}"
    return (f"{head} Either a machine was not started (or with other --main_process_ip/--main_process_port/"
            f"--num_machines), or it cannot reach TCP port {port} on machine 0 (a firewall) and its "
            f"report over UDP port {port} could not arrive either (UDP blocked too): see that machine's own "
            f"'network check failed' line. HINT: allow TCP (and UDP) port {port} to machine 0 from the other machines, "
            "and lower the wait with --rdzv_conf join_timeout=S while debugging")
