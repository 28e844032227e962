"""One log line per membership change of the machines of a c10d launch (``--num_machines MIN:MAX``).

torch's c10d rendezvous (in torchrun's agent) decides which machines take part in each round. hasten
registers a rendezvous backend in torch's public registry that is torch's own c10d handler, unchanged,
plus this: after each round, every machine's agent writes its name and address and its number of
processes to the round's store (torch's), reads the others', and prints who left or joined and the new
world size. Nothing else of the rendezvous changes, except that machine 0's network watch
(:mod:`hasten.launchers.machines.watch`) may close the first round (:func:`close_rendezvous`) when too few
machines can ever join: every machine's agent then stops instead of waiting for the join timeout.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
from datetime import timedelta
from typing import Any

__all__ = ["BACKEND", "close_rendezvous", "describe_change", "rounds_met", "use_membership_backend"]

#: The name hasten's c10d handler is registered under (torchrun is given ``c10d`` in ``--dry_run``).
BACKEND = "hasten-c10d"
_KEY = "hasten/member/"
_WAIT = timedelta(seconds=30)  # a member that died right after the round: give up the line, not the run
# This launcher's machine, and its rendezvous: how to close it, whether it was closed, rounds met so far.
_settings: dict[str, Any] = {"name": "?", "processes": 1, "closer": None, "closed": False, "rounds": 0}


def describe_change(previous: dict[str, int] | None, current: dict[str, int]) -> str:
    """The log line for a round: machine name -> its processes, before and now.

    Example:
        >>> describe_change({"a": 2, "b": 2, "c": 2}, {"a": 2, "b": 2})
        'machines changed: c left; the run goes on with 2 machines, world size 4'
    """
    size = f"{len(current)} machine{'s' if len(current) > 1 else ''}, world size {sum(current.values())}"
    if previous is None:
        return f"{size}: {', '.join(sorted(current))}"
    left = [f"{name} left" for name in sorted(set(previous) - set(current))]
    joined = [f"{name} joined" for name in sorted(set(current) - set(previous))]
    if not left and not joined:
        return f"the worker group restarts on the same {size}"
    return f"machines changed: {', '.join(left + joined)}; the run goes on with {size}"


@functools.cache
def _handler_class() -> type:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo

    class MembershipLoggingHandler(RendezvousHandler):
        """torch's c10d handler, and a log line after each round (see the module docstring)."""

        def __init__(self, inner: RendezvousHandler) -> None:
            self._inner = inner
            self._previous: dict[str, int] | None = None

        def get_backend(self) -> str:
            return BACKEND

        @property
        def use_agent_store(self) -> bool:
            return bool(self._inner.use_agent_store)

        def next_rendezvous(self) -> RendezvousInfo:
            if _settings["closed"]:  # closed before the agent got here (close_rendezvous)
                from torch.distributed.elastic.rendezvous import RendezvousClosedError

                raise RendezvousClosedError("closed by hasten's network check")
            info = self._inner.next_rendezvous()
            _settings["rounds"] += 1
            with contextlib.suppress(Exception):  # a log line must never stop the run
                self._report(info)
            return info

        def _report(self, info: RendezvousInfo) -> None:
            store = info.store
            store.set(f"{_KEY}{info.rank}", json.dumps([_settings["name"], _settings["processes"]]))
            keys = [f"{_KEY}{rank}" for rank in range(info.world_size)]
            store.wait(keys, _WAIT)
            current = dict(json.loads(store.get(key)) for key in keys)
            print(f"hasten launch: {describe_change(self._previous, current)}", file=sys.stderr, flush=True)
            self._previous = current

        def is_closed(self) -> bool:
            return bool(self._inner.is_closed())

        def set_closed(self) -> None:
            self._inner.set_closed()

        def num_nodes_waiting(self) -> int:
            return int(self._inner.num_nodes_waiting())

        def get_run_id(self) -> str:
            return str(self._inner.get_run_id())

        def shutdown(self) -> bool:
            return bool(self._inner.shutdown())

    return MembershipLoggingHandler


def _create(params: Any) -> Any:
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    backend, store = create_backend(params)

    def close() -> None:  # a handler of its own (another thread may run this one's next_rendezvous), same state
        create_handler(store, backend, params).set_closed()

    _settings["closer"] = close
    return _handler_class()(create_handler(store, backend, params))


def close_rendezvous() -> None:
    """Close this launch's c10d rendezvous for every machine (from any thread): each agent waiting in it,
    or arriving later, raises ``RendezvousClosedError`` within about a second (torch's poll interval)."""
    _settings["closed"] = True  # before the closer is read: an agent not started yet sees one or the other
    closer = _settings["closer"]
    if closer is not None:
        closer()


def rounds_met() -> int:
    """How many rounds of the rendezvous this machine completed (0 while the machines first meet)."""
    return int(_settings["rounds"])


def use_membership_backend(name: str, processes: int) -> str:
    """Register hasten's c10d handler (once) for this machine (``name``, ``processes`` local workers).

    Returns the backend name to give torchrun's agent instead of ``c10d``.
    """
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    _settings.update(name=name, processes=processes, closer=None, closed=False, rounds=0)
    rendezvous_handler_registry.register(BACKEND, _create)
    return BACKEND
