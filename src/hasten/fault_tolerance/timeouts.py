"""Every timeout of a replica-group run, derived from one setting and checked for an order that can work.

torchft has half a dozen timeouts whose order decides whether a failure is survived: a dead group must be dropped
from the Lighthouse (heartbeat) before the survivors' collectives give up, a quorum must outlast a step, hasten's
own collective watchdog must outlast a quorum. :class:`FaultToleranceConfig` derives them all from
``step_timeout`` and refuses, before anything starts, a user-given value that breaks the order, naming both values.
This module does not import torch or torchft (the launcher checks the settings with it).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from hasten.config.env import FAULT_TOLERANCE_VAR, LIGHTHOUSE_VAR, NUM_REPLICA_GROUPS_VAR, REPLICA_GROUP_VAR
from hasten.exceptions import ConfigurationError

#: Default seconds one step's collectives may take before a peer counts as failed.
DEFAULT_STEP_TIMEOUT = 30.0
#: hasten's collective watchdog default (``--collective_timeout``), used when none is given.
DEFAULT_COLLECTIVE_TIMEOUT = 300.0


@dataclass(frozen=True)
class Timeouts:
    """The resolved timeouts, in seconds (see :meth:`FaultToleranceConfig.timeouts` for how each is derived)."""

    step: float
    heartbeat: float
    heartbeat_interval: float
    join: float
    quorum: float
    connect: float
    collective: float


@dataclass(frozen=True)
class FaultToleranceConfig:
    """Per-step fault tolerance over replica groups (``Accelerator(fault_tolerance=...)``).

    Only ``step_timeout`` is needed; the others are derived from it and may be given to override, as long as
    their order still works (checked by :meth:`timeouts`).

    Args:
        step_timeout: seconds the managed all-reduce (and torchft's Manager calls) may take; a hung peer costs
            the survivors this long.
        heartbeat_timeout: seconds without a heartbeat before the Lighthouse drops a group (below
            ``step_timeout``; default ``min(step_timeout / 2, 5)``). A dead peer costs the survivors this long.
        join_timeout: seconds the Lighthouse waits for live groups to join a quorum (default ``step_timeout``).
        quorum_timeout: seconds a group waits for a quorum (at least ``2 x step_timeout + join_timeout``, the
            default).
        connect_timeout: seconds to connect to the Lighthouse and peers (at most ``step_timeout``; default
            ``min(step_timeout, 10)``).
        min_replicas: the fewest groups a step commits with.
        lighthouse: the Lighthouse address (``http://host:port``); default: ``TORCHFT_LIGHTHOUSE``.

    Example:
        >>> FaultToleranceConfig(step_timeout=10).timeouts().quorum
        30.0
    """

    step_timeout: float = DEFAULT_STEP_TIMEOUT
    heartbeat_timeout: float | None = None
    join_timeout: float | None = None
    quorum_timeout: float | None = None
    connect_timeout: float | None = None
    min_replicas: int = 1
    lighthouse: str | None = None

    def timeouts(self, collective_timeout: float | None = None) -> Timeouts:
        """Every timeout, derived from ``step_timeout``; user values are checked against the order.

        Args:
            collective_timeout: hasten's collective watchdog and process-group initialisation timeout
                (``--collective_timeout``); it must outlast a quorum. Default: 300 s or the quorum timeout.

        Raises:
            ConfigurationError: a value that is not a positive number, or an order that cannot work (the
                message names both values and the rule).
        """
        step = _positive("step_timeout", self.step_timeout)
        heartbeat = _given("heartbeat_timeout", self.heartbeat_timeout, min(step / 2, 5.0))
        join = _given("join_timeout", self.join_timeout, step)
        quorum = _given("quorum_timeout", self.quorum_timeout, 2 * step + join)
        connect = _given("connect_timeout", self.connect_timeout, min(step, 10.0))
        collective = _given("collective_timeout", collective_timeout, max(DEFAULT_COLLECTIVE_TIMEOUT, quorum))
        _order(heartbeat < step, f"heartbeat_timeout={heartbeat:g} s must be below step_timeout={step:g} s: a dead "
               "group must leave the quorum before the survivors' collectives time out")
        _order(quorum >= 2 * step + join, f"quorum_timeout={quorum:g} s must be at least 2 x step_timeout + "
               f"join_timeout = {2 * step + join:g} s (step_timeout={step:g} s, join_timeout={join:g} s): a quorum "
               "must outlast a slow step")
        _order(connect <= step, f"connect_timeout={connect:g} s must be at most step_timeout={step:g} s: a peer "
               "that cannot be reached within a step is a failed peer")
        _order(collective >= quorum, f"collective_timeout={collective:g} s must be at least quorum_timeout="
               f"{quorum:g} s: hasten's watchdog would stop a process that is waiting for a quorum")
        if isinstance(self.min_replicas, bool) or not isinstance(self.min_replicas, int) or self.min_replicas < 1:
            raise ConfigurationError(f"fault tolerance: min_replicas={self.min_replicas!r} must be an integer of "
                                     "at least 1.")
        return Timeouts(step=step, heartbeat=heartbeat, heartbeat_interval=min(0.1, heartbeat / 5), join=join,
                        quorum=quorum, connect=connect, collective=collective)

    def to_json(self) -> str:
        """The form workers receive in ``HASTEN_FAULT_TOLERANCE``."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> FaultToleranceConfig:
        """Parse :meth:`to_json`'s output.

        Raises:
            ConfigurationError: not a JSON object of this class's keys.
        """
        try:
            data: Any = json.loads(text)
        except ValueError as exc:
            raise ConfigurationError(f"{FAULT_TOLERANCE_VAR} is not JSON ({exc}).") from exc
        known = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or set(data) - known:
            raise ConfigurationError(f"{FAULT_TOLERANCE_VAR}={text!r} must be an object with keys among "
                                     f"{sorted(known)}.")
        return cls(**data)


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigurationError(f"fault tolerance: {name}={value!r} must be a positive number of seconds.")
    return float(value)


def _given(name: str, value: Any, default: float) -> float:
    return default if value is None else _positive(name, value)


def _order(holds: bool, line: str) -> None:
    if not holds:
        raise ConfigurationError(f"fault tolerance: {line}. HINT: leave it out to derive it from step_timeout.")


__all__ = ["FAULT_TOLERANCE_VAR", "LIGHTHOUSE_VAR", "NUM_REPLICA_GROUPS_VAR", "REPLICA_GROUP_VAR",
           "FaultToleranceConfig", "Timeouts"]
