"""Which address a launch listens on: loopback on one machine, the interface of ``--main_process_ip`` on many.

torch's rendezvous stores bind every interface (``0.0.0.0``/``::``). hasten instead creates the store
server itself, on a socket bound to the chosen address, and hands it to torch through the public
``TCPStore(master_listen_fd=..., multi_tenant=True)``: torch's own rendezvous code then asks for a
multi-tenant store on the same port and gets this one. The workers get ``GLOO_SOCKET_IFNAME`` (unless the
user set it) so that gloo also listens on that interface only.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from hasten.exceptions import LaunchError

LOOPBACK = "127.0.0.1"


def _is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _local_addresses() -> dict[str, str]:
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
    if num_machines == 1 and _is_loopback(main_ip):
        return LOOPBACK
    try:
        target = socket.gethostbyname(main_ip)
    except OSError as exc:
        raise LaunchError(f"--main_process_ip {main_ip!r} cannot be resolved ({exc}). HINT: pass the IP address of "
                          "the main machine.") from exc
    if _is_loopback(target) or target in _local_addresses():
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
    return _local_addresses().get(address)


@contextlib.contextmanager
def store_server(address: str, port: int, timeout: timedelta = timedelta(seconds=900)) -> Iterator[Any]:
    """Host the rendezvous ``TCPStore`` on ``address:port`` only, for torch's rendezvous to reuse.

    Raises:
        LaunchError: the port is taken on that address.
    """
    from torch.distributed import TCPStore

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((address, port))
        except OSError as exc:
            raise LaunchError(f"cannot listen on {address}:{port} for the rendezvous ({exc}). HINT: pass a free "
                              "--main_process_port, or stop the process holding it.") from exc
        listener.listen(1024)
        store = TCPStore(address, port, is_master=True, multi_tenant=True, master_listen_fd=listener.fileno(),
                         wait_for_workers=False, timeout=timeout)
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store's server owns the descriptor now and closes it
    yield store


def bind_worker_store(env: dict[str, str] | Any) -> Any:
    """In worker rank 0, when it (not the agent) hosts the process group's store: host it on ``MASTER_ADDR``.

    Returns the store to keep alive for the life of the worker, or None when there is nothing to do.
    ``init_process_group`` then reuses it (``multi_tenant``) instead of listening on every interface.
    """
    if env.get("RANK") != "0" or env.get("TORCHELASTIC_USE_AGENT_STORE") != "False" or "MASTER_PORT" not in env:
        return None
    from torch.distributed import TCPStore

    address = env.get("MASTER_ADDR", LOOPBACK)
    if address not in _local_addresses():
        return None  # a hostname or an address of another machine: leave the store to torch
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((address, int(env["MASTER_PORT"])))
    except OSError:
        listener.close()
        return None  # torch will report the busy port itself
    listener.listen(1024)
    store = TCPStore(address, int(env["MASTER_PORT"]), is_master=True, multi_tenant=True,
                     master_listen_fd=listener.fileno(), wait_for_workers=False)
    listener.detach()  # owned by the store's server from now on
    return store
