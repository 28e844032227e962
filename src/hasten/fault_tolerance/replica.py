"""One replica group's side of per-step fault tolerance: torchft's Manager, the managed gradient all-reduce,
the commit decision and the state a restarted group heals from.

Step protocol (one optimizer step): :meth:`ReplicaGroup.begin_step` starts a quorum once per step (from the
prepared loader, ``zero_grad`` or the step itself, whichever comes first). The quorum is synchronous: a group
that rejoins heals (model, optimizer, schedulers, RNG, data cursor) from a live peer *inside* it, before its
forward pass, and then takes part in the step like any other. :meth:`ReplicaGroup.commit` all-reduces the
gradients over the groups with ``manager.allreduce(...).wait()`` (never torchft's DistributedDataParallel, whose
comm hook crashes the survivor when a peer dies inside a step, see docs/design/torchft-feasibility.md) and
returns ``should_commit()``: the optimizer steps only on True; on False the step is retried with the next quorum.

torchft is imported here only (the ``torchft`` extra); nothing else in hasten imports this module unless
fault tolerance is on.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse, urlsplit, urlunsplit

import torch

from hasten.config.env import (
    FAULT_TOLERANCE_VAR,
    LIGHTHOUSE_VAR,
    NUM_REPLICA_GROUPS_VAR,
    REPLICA_GROUP_VAR,
    replica_group_env,
)
from hasten.environments.network import bind_address
from hasten.exceptions import ConfigurationError, LaunchError
from hasten.fault_tolerance.timeouts import FaultToleranceConfig, Timeouts

#: The key of hasten's state in torchft's healing checkpoint.
STATE_KEY = "hasten"


def config_from_env(env: Mapping[str, str] | None = None) -> FaultToleranceConfig | None:
    """The launch's fault-tolerance settings (``hasten launch --replica_groups N``), or None outside one."""
    text = replica_group_env(env).get(FAULT_TOLERANCE_VAR)
    return FaultToleranceConfig.from_json(text) if text else None


def _import_torchft() -> Any:
    try:
        import torchft
    except ImportError as exc:
        raise ConfigurationError("fault tolerance (replica groups) needs torchft: `pip install hasten[torchft]` "
                                 f"(torchft==0.2.0). ({exc})") from exc
    return torchft


class ReplicaGroup:
    """torchft's Manager for this process's replica group, and hasten's step protocol over it.

    Args:
        config: the settings (timeouts are derived and checked here again).
        collect_state: returns hasten's state to send to a healing peer (model, optimizer, ...).
        apply_state: loads a live peer's state (the inverse of ``collect_state``).
        device: where gradients live (gloo on CPU, NCCL on GPU).
        collective_timeout: hasten's own watchdog timeout, checked against the quorum timeout.
    """

    def __init__(self, config: FaultToleranceConfig, collect_state: Callable[[], dict[str, Any]],
                 apply_state: Callable[[dict[str, Any]], None], device: torch.device,
                 collective_timeout: float | None = None) -> None:
        torchft = _import_torchft()
        self.timeouts: Timeouts = config.timeouts(collective_timeout)
        launch = replica_group_env()
        lighthouse = config.lighthouse or launch.get(LIGHTHOUSE_VAR)
        if not lighthouse:
            raise ConfigurationError("fault tolerance needs a Lighthouse: launch with `hasten launch --replica_groups "
                                     f"N` (it starts one), or set {LIGHTHOUSE_VAR}=http://host:port / "
                                     "FaultToleranceConfig(lighthouse=...).")
        self.group_id = int(launch.get(REPLICA_GROUP_VAR, "0"))
        self.num_groups = int(launch.get(NUM_REPLICA_GROUPS_VAR, "1"))
        step = timedelta(seconds=self.timeouts.step)
        if device.type == "cuda":
            pg = torchft.ProcessGroupNCCL(timeout=step)
        else:
            pg = torchft.ProcessGroupGloo(timeout=step)
        hostname = advertised_address(lighthouse)
        self.manager = torchft.Manager(
            pg=pg, load_state_dict=None, state_dict=None, min_replica_size=config.min_replicas,
            checkpoint_transport=_checkpoint_transport(torchft, hostname, step),
            use_async_quorum=False, timeout=step, quorum_timeout=timedelta(seconds=self.timeouts.quorum),
            connect_timeout=timedelta(seconds=self.timeouts.connect), lighthouse_addr=lighthouse,
            replica_id=f"hasten_{self.group_id}", hostname=hostname,
            heartbeat_interval=timedelta(seconds=self.timeouts.heartbeat_interval))
        self.manager.register_state_dict_fn(STATE_KEY, apply_state, collect_state)
        self._open = False  # a quorum was started for the current step
        self.healed = 0  # times this group loaded a peer's state
        self.steps_committed = 0
        self.steps_retried = 0

    def begin_step(self) -> None:
        """Join this step's quorum (once per step); a group that is behind heals here, before its forward."""
        if not self._open:
            self.manager.start_quorum()
            self._open = True

    def commit(self, params: Iterable[torch.Tensor]) -> bool:
        """Average the gradients over the quorum's groups; True when the optimizer may step.

        On False (a peer failed during the step) the gradients are left as they were and the step is
        retried with the next quorum.
        """
        self.begin_step()
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            ok = self.manager.allreduce(flat).wait()
            if ok:
                offset = 0
                for grad in grads:
                    grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                    offset += grad.numel()
        committed = bool(self.manager.should_commit())
        self._open = False
        if committed:
            self.steps_committed += 1
        else:
            self.steps_retried += 1
        return committed

    def cursor(self) -> tuple[int, int, int]:
        """``(batches_committed, participant index, participants)`` of the current step's quorum."""
        self.begin_step()
        rank = self.manager.participating_rank()
        return self.manager.batches_committed(), (rank if rank is not None else -1), self.manager.num_participants()

    def writes_checkpoints(self) -> bool:
        """Whether this group writes the run's checkpoints: participant 0 of the latest quorum (no new quorum).

        The same answer on every process of the group, and exactly one group of a quorum says True.
        """
        return bool(self.manager.participating_rank() == 0)  # None before the first quorum

    def shutdown(self) -> None:
        """Stop torchft's threads and servers (the process exits without waiting for them)."""
        self.manager.shutdown(wait=False)


def advertised_address(lighthouse: str) -> str:
    """The address other groups reach this group at (its Manager, its healing checkpoint).

    Loopback when the Lighthouse is on this machine's loopback (the whole run is here); else the local address that
    routes to the Lighthouse: on several machines, the one this machine faces machine 0 with, which is where its
    group's store listens too (not the host name, which may resolve to loopback or to another network).
    """
    host = urlparse(lighthouse).hostname or ""
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    try:
        return bind_address(host, 2)
    except LaunchError as exc:
        raise ConfigurationError(f"fault tolerance: the Lighthouse {lighthouse} cannot be reached from this "
                                 f"machine ({exc})") from exc


def _checkpoint_transport(torchft: Any, host: str, timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport (as the Manager makes it), advertising ``host`` instead of the host name.

    torchft 0.2.0 advertises ``socket.gethostname()``: a peer on another machine cannot fetch a healing checkpoint
    when that name resolves to loopback there. Returns None (torchft's own) when ``host`` is loopback.
    """
    if host == "127.0.0.1":
        return None
    from torchft.checkpointing.http_transport import HTTPTransport

    class AdvertisedHTTPTransport(HTTPTransport):  # type: ignore[misc]
        def address(self) -> str:
            url = urlsplit(super().address())  # http://<host name>:<port>/checkpoint/
            return urlunsplit(url._replace(netloc=f"{host}:{url.port}"))

    return AdvertisedHTTPTransport(timeout=timeout, num_chunks=0)


def rng_state() -> dict[str, Any]:
    """Python's and torch's RNG states, in a form torchft's checkpoint transport carries."""
    version, internal, gauss = random.getstate()
    return {"torch": torch.get_rng_state(), "python": [version, list(internal), gauss]}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`rng_state`'s output."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


__all__ = ["ReplicaGroup", "advertised_address", "config_from_env", "rng_state", "set_rng_state"]
