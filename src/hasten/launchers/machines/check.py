"""The network check of a multi-machine launch, before torch's rendezvous and the first collective.

Each machine's launcher checks, in this order:

1. its own settings: the interface gloo will use (``GLOO_SOCKET_IFNAME``, else the one hasten picks)
   exists, is up and carries an IPv4 address that is not loopback; ``NCCL_SOCKET_IFNAME``, when set on a
   GPU run, selects a usable interface. A loopback ``--main_process_ip`` is right only when every
   "machine" runs on this computer (see "Loopback" below);
2. that the rendezvous endpoint (``--main_process_ip:--main_process_port``) answers a TCP connection.
   "Refused" means machine 0 has not started yet and is retried until the rendezvous timeout, unless
   machine 0's check answers over UDP (then a firewall rejects the port); no answer at all (a firewall
   drops the port) or no route fails within seconds, and is reported to machine 0 over UDP;
3. then the machines meet in torch's ``TCPStore`` (the one machine 0's launcher already hosts for the
   rendezvous): each publishes where its collectives will listen (a socket bound like gloo's, on the
   interface's address, port 0), probes every peer's socket with a TCP connection, and publishes what
   failed.

The first problem found is written to the store once (``compare_set``), so every machine that reached
the store prints the same line and stops; a machine that cannot reach the store stops with its own line
and reports it to machine 0 over UDP (:mod:`hasten.launchers.machines.reports`), which stops with a line
naming that machine (with ``--num_machines MIN:MAX`` machine 0 reads those reports all launch long and
stops only once fewer than MIN machines can join: :mod:`hasten.launchers.machines.watch`). Only sockets and
torch's store are used: no rendezvous or collective of hasten's own.

Loopback: ``127.0.0.1`` reaches only the processes of this computer's network namespace, so with a
loopback address the machines meet only if they all run here. A machine that waits for another one
asks whether that machine's launcher runs here (:func:`~hasten.launchers.machines.reports.is_present`, which
each launcher marks when it starts): if so it waits as long as the rendezvous allows, however late that
machine is; if not, it gives up after LOOPBACK_WAIT seconds with the line that names the address as the
mistake (Kubernetes pods given ``MASTER_ADDR=127.0.0.1``). When the machines meet, they compare their
host identity (boot id and network namespace): a machine that reached the loopback port from another
computer (a tunnel) is refused. None of this adds a wait to a check that passes.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from hasten.environments.network import (
    interface_addresses,
    interface_is_up,
    interface_of,
    is_loopback,
    local_addresses,
    nccl_interfaces,
)
from hasten.exceptions import LaunchError
from hasten.launchers.machines.reports import Inbox, Report, ask_host, host_identity, is_present, send_report
from hasten.launchers.machines.store import store_client

__all__ = ["NetworkCheckFailed", "PeerInfo", "check_network", "collective_address", "rendezvous_timeout"]

#: Seconds one TCP connection attempt may take before it counts as unanswered (SYN sent 2-3 times).
PROBE_TIMEOUT = 3.0
#: Unanswered attempts in a row after which the rendezvous endpoint counts as dropped by a firewall.
SILENT_LIMIT = 2
#: A loopback --main_process_ip is only right when every "machine" runs on this one (a test of a
#: multi-machine launch on one computer): a machine whose launcher does not run here gets this long.
LOOPBACK_WAIT = 6.0
#: Once every machine arrived: how long the peers' probe results (and acknowledgements) may take.
RESULT_WAIT = 10.0
_PREFIX = "hasten/network_check/"
_POLL = 0.1  # seconds between two looks at the store while waiting for the other machines
_FIREWALL_HINT = ("HINT: allow TCP between the machines: the rendezvous port, and the random ports gloo and NCCL "
                  "listen on (a firewall or a cloud security group)")


class NetworkCheckFailed(LaunchError):
    """The network check found a problem; the message is one line naming the machine, address and fix."""


@dataclass
class PeerInfo:
    """What one machine publishes: who it is and where its collectives will listen."""

    rank: int
    host: str
    address: str
    port: int
    interface: str
    host_id: str = ""  # boot id and network namespace (reports.host_identity)

    def __str__(self) -> str:
        return f"machine {self.rank} ({self.host})"


def rendezvous_timeout(rdzv_conf: str, default: float = 600.0) -> float:
    """Seconds the machines may take to meet: ``timeout`` or ``join_timeout`` of ``--rdzv_conf`` (torch's keys)."""
    for item in rdzv_conf.split(","):
        key, _, value = item.partition("=")
        if key.strip() in ("timeout", "join_timeout") and value.strip():
            with contextlib.suppress(ValueError):
                return float(value)
    return default


def _me(rank: int) -> str:
    return f"machine {rank} ({socket.gethostname()})"


def collective_address(bind_addr: str, master_addr: str, rank: int,
                       env: Mapping[str, str]) -> tuple[str, str, str | None]:
    """Where this machine's collectives will listen: ``(address, interface, problem or None)``.

    ``bind_addr`` is the address the machine advertises (the one that faces ``master_addr``).
    """
    me = _me(rank)
    if is_loopback(bind_addr):  # every "machine" must be this one: see LOOPBACK_WAIT
        return bind_addr, interface_of(bind_addr) or "lo", None
    interfaces = interface_addresses()
    own = interface_of(bind_addr) or "?"
    requested = env.get("GLOO_SOCKET_IFNAME", "")
    fix = (f"HINT: set GLOO_SOCKET_IFNAME={own} (the interface that carries {bind_addr}, the address facing "
           f"{master_addr}) or leave it unset for hasten to choose it")
    names = [name.strip() for name in requested.split(",") if name.strip()] or [own]
    for name in names:
        if name not in interfaces:
            return bind_addr, name, (f"GLOO_SOCKET_IFNAME={requested}: {me} has no interface {name!r} (it has "
                                     f"{', '.join(sorted(interfaces))}). {fix}")
        if not interface_is_up(name) or not interfaces[name]:
            return bind_addr, name, (f"GLOO_SOCKET_IFNAME={requested}: on {me} interface {name} is down or has no "
                                     f"IPv4 address. {fix}")
    address = bind_addr if bind_addr in interfaces[names[0]] else interfaces[names[0]][0]
    if is_loopback(address):
        return address, names[0], (f"GLOO_SOCKET_IFNAME={requested}: on {me} interface {names[0]} carries only the "
                                   f"loopback address {address}, which the other machines cannot reach. {fix}")
    return address, names[0], _nccl_problem(me, env, interfaces)


def _nccl_problem(me: str, env: Mapping[str, str], interfaces: dict[str, list[str]]) -> str | None:
    spec = env.get("NCCL_SOCKET_IFNAME", "")
    if not spec:
        return None
    chosen = nccl_interfaces(spec, sorted(interfaces))
    if any(interface_is_up(n) and any(not is_loopback(a) for a in interfaces[n]) for n in chosen):
        return None
    return (f"NCCL_SOCKET_IFNAME={spec}: on {me} it selects no interface that is up with a non-loopback IPv4 address "
            f"(selected: {', '.join(chosen) or 'none'}; the machine has {', '.join(sorted(interfaces))}). HINT: "
            "set NCCL_SOCKET_IFNAME to the interface of the network the machines share, or leave it unset")


_LOOPBACK_HINT = ("HINT: pass --main_process_ip with machine 0's address on the network the machines share (in "
                  "Kubernetes the main pod's IP or service name, never 127.0.0.1 or localhost), the same on every "
                  "machine")


def loopback_problem(master_addr: str, port: int, rank: int, what: str) -> str:
    """The line for a loopback ``--main_process_ip`` where the machines did not meet within LOOPBACK_WAIT."""
    return (f"{_me(rank)}: --main_process_ip {master_addr} is a loopback address, so every machine must run on this "
            f"one, but {what} within {LOOPBACK_WAIT:g} s and no launcher of it runs on this machine (port {port}). "
            f"{_LOOPBACK_HINT}")


@dataclass
class Waiting:
    """How long a machine waits for the others: the rendezvous timeout, or LOOPBACK_WAIT for a loopback
    address when a machine it waits for does not run on this computer (see the module docstring)."""

    port: int
    deadline: float
    loopback: bool = False
    window: float = 0.0  # when LOOPBACK_WAIT is over

    @classmethod
    def start(cls, port: int, timeout: float, loopback: bool) -> Waiting:
        """Waiting that starts now."""
        now = time.monotonic()
        return cls(port, now + timeout, loopback, now + min(timeout, LOOPBACK_WAIT))

    def over(self, missing: Callable[[], list[int]]) -> bool:
        """Whether to stop waiting for the machines that ``missing()`` lists (asked only past the window)."""
        now = time.monotonic()
        if now >= self.deadline:
            return True
        return self.loopback and now >= self.window and not all(is_present(self.port, r) for r in missing())


def _connect(address: str, port: int, timeout: float = PROBE_TIMEOUT) -> str | None:
    """Why a TCP connection to ``address:port`` fails ("no answer", "refused", ...), or None when it opens."""
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return None
    except TimeoutError:
        return f"no answer within {timeout:g} s"
    except ConnectionRefusedError:
        return "refused"
    except OSError as exc:
        return exc.strerror or str(exc)


def reach_endpoint(master_addr: str, port: int, rank: int, waiting: Waiting, address: str = "?") -> None:
    """Wait until ``master_addr:port`` accepts a TCP connection; refused ones are retried while ``waiting``.

    A machine other than 0 that fails reports it to machine 0 over UDP (it cannot reach the store);
    ``address`` is the one it advertises, for that report.

    Raises:
        NetworkCheckFailed: no answer twice in a row, no route, refused on machine 0 (which hosts the
            endpoint itself), refused while machine 0's check runs (a rule rejects the port), or still
            refused when the wait is over.
    """
    me, silent, where = _me(rank), 0, f"{master_addr}:{port}"

    def failed(reason: str, line: str) -> NetworkCheckFailed:
        if rank != 0:  # machine 0 hosts the store and waits there: tell it, so that it stops as well
            send_report(master_addr, port, Report(rank, socket.gethostname(), address, "failed", reason))
        return NetworkCheckFailed(line)

    while True:
        reason = _connect(master_addr, port)
        if reason is None:
            return
        if reason.startswith("no answer"):
            silent += 1
            if silent < SILENT_LIMIT:
                continue
            raise failed(reason, f"{me} gets no answer from the rendezvous endpoint {where} ({SILENT_LIMIT} tries, "
                                 f"{reason} each): a firewall drops TCP port {port} there, or --main_process_ip is "
                                 f"not machine 0's address. {_FIREWALL_HINT}, and check "
                                 "--main_process_ip/--main_process_port")
        if reason != "refused":
            raise failed(reason, f"{me} cannot reach the rendezvous endpoint {where} ({reason}). HINT: check "
                                 "--main_process_ip (machine 0's address on the network the machines share) and this "
                                 "machine's routes")
        if rank == 0:  # its own launcher listens there already
            raise NetworkCheckFailed(
                f"{me} hosts the rendezvous, but {where} refuses connections: --main_process_ip {master_addr} is not "
                f"an address of machine 0 (it has {', '.join(sorted(local_addresses()))}). HINT: pass machine 0's "
                "own address as --main_process_ip on every machine")
        if waiting.over(lambda: [0]) and waiting.loopback and time.monotonic() < waiting.deadline:
            raise NetworkCheckFailed(loopback_problem(master_addr, port, rank, "nothing listens there on this machine"))
        if waiting.over(lambda: [0]):
            raise NetworkCheckFailed(
                f"the machines could not meet at {where}: {me} was refused there until the rendezvous timeout. "
                "HINT: start machine 0 with the same --main_process_ip/--main_process_port and --num_machines")
        # Machine 0 may not have started yet. Ask its check over UDP (the answer or 0.5 s paces the retries):
        # when it runs, its launcher listened on the port before, so a refusal now comes from a firewall rule.
        if ask_host(master_addr, port, Report(rank, socket.gethostname(), address, "hello"), 0.5) and \
                _connect(master_addr, port) == "refused":
            raise failed("refused", f"{me} is refused by the rendezvous endpoint {where} although machine 0's launcher "
                                    f"runs there (its network check answered over UDP port {port}): a firewall "
                                    f"rejects TCP port {port}. {_FIREWALL_HINT}")


@contextlib.contextmanager
def _listener(address: str) -> Iterator[socket.socket]:
    """A TCP socket listening on ``address``, port 0: where gloo's listener will be (the kernel accepts)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((address, 0))
        sock.listen(1024)
        yield sock
    finally:
        sock.close()


def _probe_message(me: PeerInfo, peer: PeerInfo, reason: str) -> str:
    where = f"{peer.address}:{peer.port}"
    if reason.startswith("no answer"):
        hint = f"a firewall on {peer} or between the machines drops it. {_FIREWALL_HINT}"
    elif reason == "refused":
        hint = f"a firewall rejects it. {_FIREWALL_HINT}"
    else:
        hint = (f"its address is on a network {me} cannot reach. HINT: on {peer} set GLOO_SOCKET_IFNAME to the "
                "interface of the network the machines share (or leave it unset)")
    return (f"{me} cannot reach {peer} at {where}, where its collectives will listen (interface {peer.interface}): "
            f"{reason}; {hint}")


def reported_problem(report: Report, master_addr: str, port: int) -> str:
    """Machine 0's line for a machine that told it over UDP that it cannot connect to the rendezvous port."""
    peer, where = f"machine {report.rank} ({report.host}, {report.address})", f"{master_addr}:{port}"
    if report.reason.startswith("no answer"):
        what, hint = (f"gets no answer from it ({report.reason}): a firewall on {_me(0)} or between the machines drops "
                      f"TCP port {port}", f"{_FIREWALL_HINT}, and check --main_process_ip/--main_process_port")
    elif report.reason == "refused":
        what, hint = (f"is refused there although this launcher listens: a firewall rejects TCP port {port}",
                      _FIREWALL_HINT)
    else:
        what, hint = (f"cannot reach it ({report.reason})", f"HINT: check the routes of machine {report.rank} to "
                      f"{master_addr} and that --main_process_ip is machine 0's address on the network they share")
    return (f"{_me(0)} hosts the rendezvous endpoint {where}, but {peer} {what} (machine {report.rank} said so over UDP "
            f"port {port}). {hint}")


class _Meeting:
    """The check's keys in torch's store: publish, wait for the others, and stop all at the first problem."""

    def __init__(self, store: Any, rank: int, nnodes: int, endpoint: str, waiting: Waiting,
                 inbox: Inbox | None = None) -> None:
        self.store, self.rank, self.nnodes, self.endpoint = store, rank, nnodes, endpoint
        self.waiting, self.inbox = waiting, inbox  # machine 0 reads the others' UDP reports in ``inbox``
        self.loopback = waiting.loopback

    def abort(self, line: str) -> NetworkCheckFailed:
        """Record ``line`` as the problem (the first one recorded wins); return the error to raise."""
        first = self.store.compare_set(_PREFIX + "abort", "", line)
        return NetworkCheckFailed(first.decode() if isinstance(first, bytes) else str(first))

    def wait_for(self, kind: str, deadline: float | None = None) -> list[bytes]:
        """The values every machine published under ``kind``, or raise the recorded problem / a timeout.

        Without ``deadline``, the machines are waited for as :class:`Waiting` says (they are arriving).
        """
        keys = [f"{_PREFIX}{kind}/{r}" for r in range(self.nnodes)]
        host, _, port = self.endpoint.rpartition(":")

        def missing_ranks() -> list[int]:
            return [r for r, key in enumerate(keys) if not self.store.check([key])]

        while not self.store.check(keys):
            if self.store.check([_PREFIX + "abort"]):
                raise NetworkCheckFailed(self.store.get(_PREFIX + "abort").decode())
            report = self.inbox.poll() if self.inbox is not None else None
            if report is not None:
                raise self.abort(reported_problem(report, host, int(port)))
            if time.monotonic() >= deadline if deadline is not None else self.waiting.over(missing_ranks):
                missing = [str(r) for r in missing_ranks()]
                if self.loopback and deadline is None and time.monotonic() < self.waiting.deadline:
                    raise self.abort(loopback_problem(host, int(port), self.rank,
                                                      f"machine(s) {', '.join(missing)} did not arrive"))
                raise self.abort(
                    f"the machines could not meet at {self.endpoint}: machine(s) {', '.join(missing)} did not "
                    f"{'arrive' if kind == 'peer' else 'finish the network check'} in time (this is machine "
                    f"{self.rank}). HINT: start every machine with the same --main_process_ip/--main_process_port "
                    "and --num_machines and its own --machine_rank. A machine that cannot reach that port stops "
                    "with its own line and reports it to machine 0 over UDP (same port number), which stops every "
                    "machine at once: a wait this long means that it was not started, or that a firewall blocks UDP "
                    "to machine 0 as well (see that machine's output)")
            time.sleep(_POLL)
        return [self.store.get(key) for key in keys]

    def linger(self, key: str, count: int) -> None:
        """Machine 0 hosts the store: keep it until ``count`` machines added to ``key`` (at most RESULT_WAIT)."""
        if self.rank != 0:
            return
        deadline = time.monotonic() + RESULT_WAIT
        while int(self.store.add(_PREFIX + key, 0)) < count and time.monotonic() < deadline:
            time.sleep(_POLL)


def _probe_all(me: PeerInfo, peers: list[PeerInfo]) -> list[str]:
    others = [peer for peer in peers if peer.rank != me.rank]
    if not others:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(others))) as pool:
        reasons = list(pool.map(lambda peer: _connect(peer.address, peer.port), others))
    return [_probe_message(me, peer, reason) for peer, reason in zip(others, reasons) if reason is not None]


def _store_client(master_addr: str, port: int, rank: int) -> Any:
    try:
        return store_client(master_addr, port, RESULT_WAIT)
    except (RuntimeError, OSError) as exc:  # DistNetworkError/DistStoreError are RuntimeErrors
        raise NetworkCheckFailed(f"{_me(rank)} reaches {master_addr}:{port} but cannot use torch's rendezvous store "
                                 f"there ({type(exc).__name__}: {exc}). HINT: check that --main_process_port is the "
                                 "port of machine 0's hasten launch, not another service") from exc


def check_network(bind_addr: str, master_addr: str, port: int, rank: int, nnodes: int,
                  env: Mapping[str, str], timeout: float, meet: bool = True) -> list[PeerInfo]:
    """Run the check on this machine; return every machine's :class:`PeerInfo` when all is well.

    Args:
        bind_addr: the address this machine advertises (the one facing ``master_addr``).
        master_addr: ``--main_process_ip``; ``port``: ``--main_process_port``.
        rank: this machine's rank; ``nnodes``: the number of machines.
        env: the launcher's environment (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``).
        timeout: seconds the machines may take to arrive (the rendezvous timeout).
        meet: probe the other machines too. False for ``--num_machines MIN:MAX``, where machines come and
            go (then only this machine's settings and the endpoint are checked, and only it is returned).

    Raises:
        NetworkCheckFailed: one line naming the machine, the address/port and the likely fix.
    """
    waiting = Waiting.start(port, timeout, is_loopback(bind_addr))
    with contextlib.ExitStack() as stack:
        # Machine 0 reads the others' UDP reports while it waits for them (opened before anyone reports).
        inbox = stack.enter_context(contextlib.closing(Inbox(bind_addr, port, nnodes))) if rank == 0 and meet else None
        address, interface, problem = collective_address(bind_addr, master_addr, rank, env)
        try:
            reach_endpoint(master_addr, port, rank, waiting, address)
        except NetworkCheckFailed:
            if problem:
                raise NetworkCheckFailed(problem) from None  # this machine's own mistake explains it better
            raise
        if not meet:
            if problem:
                raise NetworkCheckFailed(problem)
            return [PeerInfo(rank, socket.gethostname(), address, 0, interface, host_identity())]
        meeting = _Meeting(_store_client(master_addr, port, rank), rank, nnodes, f"{master_addr}:{port}", waiting,
                           inbox)
        try:
            return _meet(meeting, address, interface, problem)
        except NetworkCheckFailed:
            # Machine 0 hosts the store: it stays until every machine that arrived has read the problem.
            with contextlib.suppress(RuntimeError):  # the store may be gone already (machine 0 stopped)
                meeting.store.add(_PREFIX + "stopped", 1)
                meeting.linger("stopped", int(meeting.store.add(_PREFIX + "arrived", 0)))
            raise
        except RuntimeError as exc:  # torch's DistNetworkError/DistStoreError: the store went away
            raise NetworkCheckFailed(f"{_me(rank)} lost the rendezvous store at {master_addr}:{port} during the "
                                     f"network check ({type(exc).__name__}: {exc}): machine 0's launcher stopped. "
                                     "HINT: see machine 0's output") from exc


def _meet(meeting: _Meeting, address: str, interface: str, problem: str | None) -> list[PeerInfo]:
    store, rank = meeting.store, meeting.rank
    store.add(_PREFIX + "arrived", 1)
    if int(store.add(f"{_PREFIX}rank/{rank}", 1)) > 1:
        problem = (f"two machines use --machine_rank {rank} (this is {_me(rank)}). HINT: give each machine its own "
                   f"--machine_rank, 0 to {meeting.nnodes - 1}")
    if problem:
        raise meeting.abort(problem)
    with _listener(address) as sock:
        me = PeerInfo(rank, socket.gethostname(), address, sock.getsockname()[1], interface, host_identity())
        store.set(f"{_PREFIX}peer/{rank}", json.dumps(asdict(me)))
        peers = [PeerInfo(**json.loads(raw)) for raw in meeting.wait_for("peer")]
        elsewhere = [peer for peer in peers if peer.host_id != peers[0].host_id]
        if meeting.loopback and elsewhere:
            raise meeting.abort(f"{elsewhere[0]} reaches the rendezvous {meeting.endpoint}, a loopback address, but does "
                                f"not run on the computer of machine 0 (another boot id or network namespace: a "
                                f"tunnel or a forwarded port?), so the collectives cannot meet on loopback. "
                                f"{_LOOPBACK_HINT}")
        failures = _probe_all(me, peers)
        if failures:
            raise meeting.abort(failures[0])
        store.set(f"{_PREFIX}probed/{rank}", "ok")
        meeting.wait_for("probed", time.monotonic() + RESULT_WAIT)  # keep listening until every peer probed
    store.add(_PREFIX + "done", 1)
    meeting.linger("done", meeting.nnodes)
    return peers


def describe(peers: list[PeerInfo], endpoint: str, met: bool = True) -> str:
    """One line: the machines that passed, where their collectives listen."""
    if not met:
        me = peers[0]
        return (f"network check passed on {me}: it reaches the rendezvous {endpoint} and its collectives will listen "
                f"on {me.address} ({me.interface}); with MIN:MAX machines the peers are not probed")
    shown = ", ".join(f"{p.rank}: {p.address} on {p.interface}" for p in peers[:8])
    more = f", ... ({len(peers)} in all)" if len(peers) > 8 else ""
    return f"network check passed: {len(peers)} machines reach the rendezvous {endpoint} and each other ({shown}{more})"
