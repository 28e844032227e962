"""Simulated machines for tests: one Linux network namespace per machine, each with its own IPv4 address.

Two machines are joined by a veth pair; three or more by veth pairs to a bridge that lives in its own
namespace, so nothing is added to the host's network and all traffic stays on addresses created here.
Needs root and iproute2 (``ip``); :func:`netns_unavailable` says why not when they are missing.

Example:
    >>> with simulated_machines(2) as machines:  # doctest: +SKIP
    ...     machines[1].run(["ping", "-c1", machines[0].ip])
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

SUBNET = "10.213.7"


def netns_unavailable() -> str | None:
    """Why namespaced machines cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    probe = f"hxprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@dataclass
class Machine:
    """One simulated machine: a network namespace with one interface and address."""

    name: str
    ip: str
    interface: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed so that it runs inside this machine's namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[str]:
        """Start ``argv`` inside this machine (text mode, in its own process group)."""
        return subprocess.Popen(self.command(argv), text=True, start_new_session=True, **kwargs)

    def kill(self) -> None:
        """The machine dies: SIGKILL every process running in its namespace."""
        _kill_namespace_processes(self.name)


def _ip(*args: str, netns: str | None = None) -> None:
    argv = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")


def _kill_namespace_processes(name: str) -> None:
    listed = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=30)
    for pid in listed.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


@contextlib.contextmanager
def simulated_machines(count: int, tag: str | None = None) -> Iterator[list[Machine]]:
    """Create ``count`` namespaced machines (10.213.7.1, .2, ...); remove them and their processes after."""
    tag = tag or f"hx{os.getpid() % 100000}"
    machines = [Machine(f"{tag}m{i}", f"{SUBNET}.{i + 1}", f"veth{i}") for i in range(count)]
    bridge = f"{tag}br"
    created: list[str] = []
    try:
        for machine in machines:
            _ip("netns", "add", machine.name)
            created.append(machine.name)
            _ip("link", "set", "lo", "up", netns=machine.name)
        if count == 2:
            a, b = machines
            _ip("link", "add", a.interface, "netns", a.name, "type", "veth", "peer", "name", b.interface,
                "netns", b.name)
        else:
            _ip("netns", "add", bridge)
            created.append(bridge)
            _ip("link", "add", "br0", "type", "bridge", netns=bridge)
            _ip("link", "set", "br0", "up", netns=bridge)
            for i, machine in enumerate(machines):
                _ip("link", "add", machine.interface, "netns", machine.name, "type", "veth", "peer", "name",
                    f"port{i}", "netns", bridge)
                _ip("link", "set", f"port{i}", "master", "br0", netns=bridge)
                _ip("link", "set", f"port{i}", "up", netns=bridge)
        for machine in machines:
            _ip("addr", "add", f"{machine.ip}/24", "dev", machine.interface, netns=machine.name)
            _ip("link", "set", machine.interface, "up", netns=machine.name)
        yield machines
    finally:
        for name in created:
            _kill_namespace_processes(name)
        for name in reversed(created):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
