"""``python -m hasten.fault_tolerance.lighthouse``: torchft's Lighthouse in a process of its own.

``hasten launch --replica_groups N`` starts it (so the launcher itself never imports torchft's Rust runtime and
can fork its groups), reads the one line it prints first (the address, ``http://host:port``), and terminates it
when the run ends, so that no late group forms a quorum alone and trains on.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGTERM/SIGINT or until stdin closes (the launcher is gone)."""
    parser = argparse.ArgumentParser("python -m hasten.fault_tolerance.lighthouse")
    parser.add_argument("--bind", default="127.0.0.1:0")
    parser.add_argument("--min_replicas", type=int, default=1)
    parser.add_argument("--join_timeout", type=float, required=True, help="seconds")
    parser.add_argument("--heartbeat_timeout", type=float, required=True, help="seconds")
    args = parser.parse_args(argv)
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind=args.bind, min_replicas=args.min_replicas,
                              join_timeout_ms=int(args.join_timeout * 1000), quorum_tick_ms=100,
                              heartbeat_timeout_ms=int(args.heartbeat_timeout * 1000))
    address = server.address()
    host = args.bind.rsplit(":", 1)[0]
    if host not in ("0.0.0.0", "[::]", "::"):  # advertise the address it was bound to, not the host name
        address = f"http://{host}:{address.rsplit(':', 1)[1]}"
    print(address, flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    def stop_when_stdin_closes() -> None:
        sys.stdin.read()
        stop.set()

    watcher = threading.Thread(target=stop_when_stdin_closes, daemon=True)
    watcher.start()
    stop.wait()
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
