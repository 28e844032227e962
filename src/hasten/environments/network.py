"""Network addresses of this machine: which one a run listens on and which interface gloo should use.

One machine listens on loopback; several machines on the local address that faces the main machine
(``--main_process_ip`` / ``MASTER_ADDR``), never on every interface.
"""

from __future__ import annotations

import ipaddress
import socket

from hasten.exceptions import LaunchError

LOOPBACK = "127.0.0.1"


def is_loopback(host: str) -> bool:
    """True for ``localhost``, an empty host and every 127.x / ::1 address (a name is not resolved)."""
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def local_addresses() -> dict[str, str]:
    """IPv4 address -> interface name, for every interface of this machine (network namespace)."""
    import psutil

    return {a.address: name for name, addrs in psutil.net_if_addrs().items() for a in addrs
            if a.family == socket.AF_INET}


def bind_address(main_ip: str, num_machines: int) -> str:
    """The local IPv4 address this machine's launcher and workers listen on.

    One machine: ``127.0.0.1``. Several: ``main_ip`` itself on the machine that owns it, else the local
    address the kernel routes ``main_ip`` through (found with an unconnected UDP socket: no packet is sent).

    Raises:
        LaunchError: ``main_ip`` cannot be resolved or reached from any local interface.
    """
    if num_machines == 1 and is_loopback(main_ip):
        return LOOPBACK
    try:
        target = socket.gethostbyname(main_ip)
    except OSError as exc:
        raise LaunchError(f"--main_process_ip {main_ip!r} cannot be resolved ({exc}). HINT: pass the IP address of "
                          "the main machine.") from exc
    if is_loopback(target) or target in local_addresses():
        return target
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((target, 9))
        except OSError as exc:
            raise LaunchError(f"--main_process_ip {main_ip} is not reachable from this machine ({exc}). HINT: check "
                              "the address and this machine's network routes.") from exc
        return str(probe.getsockname()[0])


def interface_of(address: str) -> str | None:
    """The name of the local interface that holds ``address`` (``lo`` for 127.0.0.1), or None."""
    return local_addresses().get(address)


def gloo_interface_for(master_addr: str, single_machine: bool) -> str | None:
    """The interface gloo should use to reach ``master_addr`` (None when it cannot be told)."""
    try:
        return interface_of(bind_address(master_addr, 1 if single_machine else 2))
    except (LaunchError, OSError):
        return None


def interface_addresses() -> dict[str, list[str]]:
    """Interface name -> its IPv4 addresses (an empty list for an interface without one)."""
    import psutil

    return {name: [a.address for a in addrs if a.family == socket.AF_INET]
            for name, addrs in psutil.net_if_addrs().items()}


def interface_is_up(name: str) -> bool:
    """True when the interface ``name`` exists and is administratively up."""
    import psutil

    stats = psutil.net_if_stats().get(name)
    return bool(stats and stats.isup)


def nccl_interfaces(spec: str, names: list[str]) -> list[str]:
    """The interfaces of ``names`` that ``NCCL_SOCKET_IFNAME=spec`` selects, with NCCL's rules.

    ``eth,ib`` selects names starting with ``eth`` or ``ib``; a leading ``^`` excludes those prefixes
    instead; a leading ``=`` (after any ``^``) makes the names exact.

    Example:
        >>> nccl_interfaces("^docker,lo", ["lo", "docker0", "eth0"])
        ['eth0']
    """
    exclude = spec.startswith("^")
    spec = spec[1:] if exclude else spec
    exact = spec.startswith("=")
    spec = spec[1:] if exact else spec
    wanted = [part for part in spec.split(",") if part]

    def matches(name: str) -> bool:
        return any(name == part if exact else name.startswith(part) for part in wanted)

    return [name for name in names if matches(name) != exclude]
