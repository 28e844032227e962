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

import logging
import random
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse, urlsplit, urlunsplit

import torch

from hasten._private_api import forget_failed_quorum
from hasten.config.env import (
    FAULT_TOLERANCE_VAR,
    LIGHTHOUSE_VAR,
    NUM_REPLICA_GROUPS_VAR,
    REPLICA_GROUP_VAR,
    rendezvous_store,
    replica_group_env,
)
from hasten.environments.network import bind_address
from hasten.exceptions import ConfigurationError, LaunchError
from hasten.fault_tolerance.shards import local_shard
from hasten.fault_tolerance.timeouts import FaultToleranceConfig, Timeouts

#: The key of hasten's state in torchft's healing checkpoint.
STATE_KEY = "hasten"

logger = logging.getLogger("hasten.fault_tolerance")


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
        group_size: the processes of this replica group.
        align_group: makes the group's processes hold its rank 0's replicated weights (a collective of the
            group); called after each quorum until the first step commits (see :meth:`begin_step`).
    """

    def __init__(self, config: FaultToleranceConfig, collect_state: Callable[[], dict[str, Any]],
                 apply_state: Callable[[dict[str, Any]], None], device: torch.device,
                 collective_timeout: float | None = None, group_size: int = 1,
                 align_group: Callable[[], None] | None = None) -> None:
        torchft = _import_torchft()
        self.timeouts: Timeouts = config.timeouts(collective_timeout)
        launch = replica_group_env()
        lighthouse = config.lighthouse or launch.get(LIGHTHOUSE_VAR)
        if not lighthouse:
            raise ConfigurationError("fault tolerance needs a Lighthouse: launch with `hasten launch --replica_groups "
                                     f"N` (it starts one), or set {LIGHTHOUSE_VAR}=http://host:port / "
                                     "FaultToleranceConfig(lighthouse=...).")
        self.group_id = int(launch.get(REPLICA_GROUP_VAR, "0"))
        self.group_size, self.align_group = group_size, align_group
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
        self._started = False  # every launched group was in a quorum, or this group healed from a started run
        self._averaged = False  # the current step's gradients were averaged over the groups
        self.healed = 0  # times this group loaded a peer's state
        self.steps_committed = 0
        self.steps_retried = 0
        self.quorums_retried = 0  # timed-out quorums retried (see begin_step)

    def begin_step(self) -> None:
        """Join this step's quorum (once per step); a group that is behind heals here, before its forward.

        A quorum that times out is retried once, when every process of this group timed out with it: another
        group that lost a process (or has one hung) can hold the Lighthouse's quorum up until its own quorum
        times out, and it then leaves (its processes do not pass this check), so the retry forms without it.
        A process whose group is not whole raises the ``TimeoutError``, and its group is restarted and heals.
        """
        if self._open:
            return
        self._join_quorum()
        if not self._started:
            self._wait_for_every_group()
        self._open = True
        if self.align_group is not None and self.manager.current_step() == 0:
            # Before the first commit the groups may hold different weights, and torchft heals each group rank
            # from the same rank of a source group, spreading the ranks over the sources (its group ranks are
            # shards): a group of replicated processes could mix two groups' weights. Every group's rank 0
            # healed from (or is) rank 0's source, so aligning each group on its rank 0 makes every process
            # equal. After a commit every group holds the same state, and any source will do.
            self.align_group()

    def _join_quorum(self) -> None:
        """One quorum of the Lighthouse, retried once when this whole group timed out (see :meth:`begin_step`)."""
        try:
            self.manager.start_quorum()
        except TimeoutError:
            if not self._whole_group_timed_out():
                raise
            logger.warning("replica group %d: the quorum timed out after %g s; every process of this group is "
                           "here, so it is retried once (another group was leaving)", self.group_id,
                           self.timeouts.quorum)
            forget_failed_quorum(self.manager)
            self.quorums_retried += 1
            self.manager.start_quorum()  # a second timeout is raised: the Lighthouse or every other group is gone

    def _wait_for_every_group(self) -> None:
        """At start, take part in a step only with every launched group in the quorum (a bounded wait).

        torchft's Lighthouse forms a quorum at once when every *heartbeating* group has joined, so a group whose
        peers are still starting would commit steps alone, and if it then died nobody would hold them: the others
        would start the epoch again and use those samples twice. While the quorum is at step 0 (no group has
        committed), the quorum is joined again, with a growing pause, until it holds ``--replica_groups`` groups,
        like torchrun's rendezvous waits for every node. After that (or when this group heals from one that has
        committed) fewer groups may step. The wait is bounded by the initialisation timeout
        (``collective_timeout``).

        Raises:
            TimeoutError: a launched group did not join within ``collective_timeout``.
        """
        deadline = time.monotonic() + self.timeouts.collective
        pause, warned = self.timeouts.heartbeat_interval, False
        while self.manager.current_step() == 0 and self.manager.num_participants() < self.num_groups:
            here = self.manager.num_participants()
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"replica group {self.group_id}: only {here} of {self.num_groups} replica groups joined the first "
                    f"quorum within collective_timeout={self.timeouts.collective:g} s; a run starts only with every "
                    "group (--replica_groups). HINT: see the missing group's error above, or raise "
                    "--collective_timeout if the groups start slowly.")
            if not warned:  # say so once
                warned = True
                logger.warning("replica group %d: waiting for every replica group to join the first quorum (%d of %d "
                               "here, at most %g s)", self.group_id, here, self.num_groups, self.timeouts.collective)
            # A pause, not a spin of quorums of one: while this group is out of the Lighthouse's quorum, a joining
            # group cannot form one alone (fewer than half of the heartbeating groups), and the next join meets it.
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(2 * pause, 1.0, self.timeouts.heartbeat)
            self._join_quorum()
        self._started = True

    def _whole_group_timed_out(self) -> bool:
        """Whether every process of this group reached the same timed-out quorum, within ``step_timeout``.

        They meet on the group's own store (torchrun's, as torchft's Manager does), not on a process group:
        a process that died or hangs is simply missing.
        """
        if self.group_size == 1:
            return True
        address = rendezvous_store()
        if address is None:
            return False
        from torch.distributed import TCPStore

        wait = timedelta(seconds=self.timeouts.step)
        key = f"hasten_ft/quorum_timed_out/{self.manager.current_step()}/{self.quorums_retried}"
        try:
            store = TCPStore(address[0], address[1], is_master=False, wait_for_workers=False, timeout=wait)
            if store.add(key, 1) == self.group_size:
                store.set(f"{key}/all", "1")
            store.wait([f"{key}/all"], wait)
        except RuntimeError:  # a process of the group is missing (DistStoreError), or the store is gone
            return False
        return True

    def commit(self, params: Iterable[torch.Tensor]) -> bool:
        """Average the gradients over the quorum's groups; True when the optimizer may step.

        On False (a peer failed during the step) the gradients are left as they were and the step is
        retried with the next quorum.
        """
        self.average_gradients(params)
        committed = bool(self.manager.should_commit())
        self._open = self._averaged = False
        if committed:
            self.steps_committed += 1
        else:
            self.steps_retried += 1
        return committed

    def average_gradients(self, params: Iterable[torch.Tensor]) -> None:
        """Average the step's gradients over the quorum's groups, once per step (clipping calls it first).

        Each rank averages its *local* shards (FSDP2 / tensor parallel inside a group): rank ``i`` of every group
        holds the same shards, and torchft's managed process group connects the groups' rank ``i``. On an error
        the gradients are left as they were; the step then does not commit.
        """
        self.begin_step()
        if self._averaged:
            return
        self._averaged = True
        with torch.no_grad():
            grads = [local_shard(p.grad) for p in params if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads]) if grads else None
            # Every group's rank i holds shards of the same sizes: all of them skip an empty one, or none does.
            if flat is None or flat.numel() == 0 or not self.manager.allreduce(flat).wait():
                return
            offset = 0
            for grad in grads:
                grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()

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
