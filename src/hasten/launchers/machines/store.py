"""Which address a launch listens on: loopback on one machine, the interface of ``--main_process_ip`` on many.

torch's rendezvous stores bind every interface (``0.0.0.0``/``::``). hasten instead creates the store
server itself, on a socket bound to the chosen address, and hands it to torch through the public
``TCPStore(master_listen_fd=..., multi_tenant=True)``: torch's own rendezvous code then asks for a
multi-tenant store on the same port and gets this one. The workers get ``GLOO_SOCKET_IFNAME`` (unless the
user set it) so that gloo also listens on that interface only.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from hasten.environments.network import LOOPBACK, local_addresses
from hasten.exceptions import LaunchError

__all__ = ["bind_worker_store", "listening_store", "store_client", "store_server"]


def listening_store(address: str, port: int, timeout: timedelta = timedelta(seconds=300)) -> Any:
    """The one way hasten hosts a ``TCPStore``: a multi-tenant server on a socket bound to ``address:port``.

    torch's own rendezvous and ``init_process_group`` then ask for a multi-tenant store on that port and
    reuse this one instead of listening on every interface. ``timeout`` bounds the store's waits (torch's
    default, 300 s, unless given).

    Raises:
        OSError: the port cannot be bound on that address (the socket is closed again).
    """
    from torch.distributed import TCPStore

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address, port))
        listener.listen(1024)
        store = TCPStore(address, port, is_master=True, multi_tenant=True, master_listen_fd=listener.fileno(),
                         wait_for_workers=False, timeout=timeout)
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store's server owns the descriptor now and closes it
    return store


def store_client(master_addr: str, port: int, timeout: float) -> Any:
    """A client of the store machine 0 hosts (``timeout`` seconds to connect and for each wait)."""
    from torch.distributed import TCPStore

    return TCPStore(master_addr, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout))


@contextlib.contextmanager
def store_server(address: str, port: int, timeout: timedelta = timedelta(seconds=900)) -> Iterator[Any]:
    """Host the rendezvous ``TCPStore`` on ``address:port`` only, for torch's rendezvous to reuse.

    Raises:
        LaunchError: the port is taken on that address.
    """
    try:
        store = listening_store(address, port, timeout)
    except OSError as exc:
        raise LaunchError(f"cannot listen on {address}:{port} for the rendezvous ({exc}). HINT: pass a free "
                          "--main_process_port, or stop the process holding it.") from exc
    yield store


def bind_worker_store(env: dict[str, str] | Any) -> Any:
    """In worker rank 0, when it (not the agent) hosts the process group's store: host it on ``MASTER_ADDR``.

    Returns the store to keep alive for the life of the worker, or None when there is nothing to do.
    ``init_process_group`` then reuses it (``multi_tenant``) instead of listening on every interface.
    """
    if env.get("RANK") != "0" or env.get("TORCHELASTIC_USE_AGENT_STORE") != "False" or "MASTER_PORT" not in env:
        return None
    address = env.get("MASTER_ADDR", LOOPBACK)
    if address not in local_addresses():
        return None  # a hostname or an address of another machine: leave the store to torch
    try:
        return listening_store(address, int(env["MASTER_PORT"]))
    except OSError:
        return None  # torch will report the busy port itself
