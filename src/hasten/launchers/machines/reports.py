"""What the network check learns outside torch's store: who runs on this computer, and reports over UDP.

- **Presence.** Each launcher of a multi-machine launch with a loopback address binds an abstract Unix
  datagram socket named after the rendezvous port and its machine rank, as soon as it starts (before
  torch is imported). Abstract Unix names are scoped to the network namespace, exactly like
  ``127.0.0.1``, and disappear with the process, so "machine 1's launcher runs on this computer" is one
  ``connect()`` away, with no file to clean up. A machine that waits for another one present here knows
  it is only slow to start; one that is absent runs elsewhere (or was never started). Linux only:
  elsewhere nobody is ever present, and the check falls back to its short window.
- **Host identity.** The boot id and the network namespace: equal for two launchers exactly when they
  share one loopback. The machines compare it when they meet over a loopback address, which catches a
  tunnel or forwarded port that made machine 0's loopback port reachable from another computer.
- **Reports.** Machine 0 hosts the rendezvous, so a machine that cannot open a TCP connection to it
  cannot tell it through the store. It sends a UDP datagram to the same address and port number
  instead (a different port space), which a firewall that drops or rejects only that TCP port lets
  through: machine 0 then stops within seconds too. Where UDP is blocked as well, machine 0 waits for
  the rendezvous timeout, as it must (nothing reaches it). The datagrams are read during machine 0's
  network check, and with ``--num_machines MIN:MAX`` for the whole launch (:mod:`hasten.launchers.machines.watch`);
  one carries a machine rank, host, address and reason, and nothing is executed.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

__all__ = ["Inbox", "Report", "ask_host", "host_identity", "is_present", "present", "send_report"]

_MAGIC = "hasten-network-check/1"
_LINUX = sys.platform.startswith("linux")


def _presence_name(port: int, rank: int) -> bytes:
    return f"\0hasten-launch/{port}/{rank}".encode()


@contextlib.contextmanager
def present(port: int, rank: int) -> Iterator[bool]:
    """Mark this launcher as machine ``rank`` of the launch on ``port``, on this computer, while inside.

    Yields whether the mark was made (False off Linux, or when another launcher here holds the same name).
    """
    if not _LINUX:
        yield False
        return
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind(_presence_name(port, rank))
    except OSError:  # another launch with this port and rank runs here: it answers for the name
        sock.close()
        yield False
        return
    try:
        yield True
    finally:
        sock.close()


def is_present(port: int, rank: int) -> bool:
    """Whether the launcher of machine ``rank`` (launch on ``port``) runs in this computer's network namespace."""
    if not _LINUX:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(_presence_name(port, rank))
        except OSError:
            return False
    return True


def host_identity() -> str:
    """This computer and network namespace: the boot id and the namespace's inode (the host name elsewhere)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        ns = os.stat("/proc/self/ns/net")
        namespace = f"{ns.st_dev}:{ns.st_ino}"
    except OSError:
        namespace = "-"
    return f"{boot}/{namespace}"


@dataclass
class Report:
    """A machine that cannot open a TCP connection to the rendezvous port tells machine 0 why.

    ``kind`` is ``hello`` (is machine 0's check running? it answers ``here``) or ``failed``.
    """

    rank: int
    host: str
    address: str
    kind: str
    reason: str = ""

    def encode(self, port: int) -> bytes:
        """The datagram: magic, port and the fields, as JSON."""
        return json.dumps({"magic": _MAGIC, "port": port, **asdict(self)}).encode()


def _decode(data: bytes, port: int) -> dict[str, object] | None:
    try:
        message = json.loads(data.decode())
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(message, dict) or message.get("magic") != _MAGIC or message.get("port") != port:
        return None
    return message


def send_report(master_addr: str, port: int, report: Report) -> None:
    """Send ``report`` to machine 0 (twice: UDP may lose one); never raises."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _ in range(2):
            sock.sendto(report.encode(port), (master_addr, port))


def ask_host(master_addr: str, port: int, report: Report, wait: float) -> bool:
    """Send a ``hello``; whether machine 0's check answered within ``wait`` seconds (it runs there).

    Without an answer the call takes ``wait`` seconds, so it paces the caller's retries.
    """
    deadline = time.monotonic() + wait
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        with contextlib.suppress(OSError):  # unsent: the wait below still paces the caller's retries
            sock.sendto(report.encode(port), (master_addr, port))
        while (left := deadline - time.monotonic()) > 0:
            if not select.select([sock], [], [], left)[0]:
                break  # the whole wait passed in silence
            with contextlib.suppress(OSError):
                message = _decode(sock.recv(4096), port)
                if message is not None and message.get("kind") == "here":
                    return True
    return False


class Inbox:
    """Machine 0's UDP socket on the rendezvous address and port number, read while its check waits."""

    def __init__(self, address: str, port: int, nnodes: int) -> None:
        self.port, self.nnodes = port, nnodes
        self.sock: socket.socket | None = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            self.sock.bind((address, port))
            self.sock.setblocking(False)
        except OSError:  # the UDP port is taken: the check goes on without reports
            self.sock.close()
            self.sock = None

    def poll(self) -> Report | None:
        """The first ``failed`` report waiting, if any; ``hello``s are answered on the way."""
        while self.sock is not None:
            try:
                data, sender = self.sock.recvfrom(4096)
            except OSError:  # nothing waiting (BlockingIOError) or an ICMP error of an earlier answer
                return None
            message = _decode(data, self.port)
            rank = None if message is None else message.get("rank")
            if message is None or not isinstance(rank, int) or not 0 < rank < self.nnodes:
                continue  # not from a machine of this launch
            if message.get("kind") == "hello":
                with contextlib.suppress(OSError):
                    self.sock.sendto(json.dumps({"magic": _MAGIC, "port": self.port, "kind": "here"}).encode(),
                                     sender)
            elif message.get("kind") == "failed":
                return Report(rank, str(message.get("host", "?")), str(message.get("address", "?")), "failed",
                              str(message.get("reason", "")))
        return None

    def wait(self, timeout: float) -> Report | None:
        """Like :meth:`poll`, after waiting up to ``timeout`` seconds for a datagram (for a thread that only listens)."""
        if self.sock is None:
            return None
        with contextlib.suppress(OSError, ValueError):  # closed meanwhile: poll() says nothing
            select.select([self.sock], [], [], timeout)
        return self.poll()

    def close(self) -> None:
        """Stop listening."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
