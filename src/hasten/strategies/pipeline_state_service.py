"""The main process reads every pipeline stage's state alone: what transformers' Trainer checkpoints need.

Trainer (transformers 5.x) writes its checkpoint on the main process alone: the model with
``model.save_pretrained(path)`` and the optimizer with ``optimizer.state_dict()``; the other processes run
no hasten code then, so a collective gather would hang. Under pipeline parallelism with unsharded stages
(pure PP, PP x DDP) each stage of the main process's pipeline (the ``pp`` group of global rank 0) therefore
runs a small state server: a daemon thread that waits on a dedicated gloo group (made collectively at
``prepare``) for a request from the main process and answers with its stage's state under the full
model's names, serialized (``torch.save`` into bytes; the length, then the bytes).

Consistency: a request names the optimizer step the main process has completed (``k``). The server
waits until its stage has completed step ``k`` too, then serializes while holding :class:`StepClock`'s
lock, which every optimizer step holds. The stage cannot complete step ``k + 1`` before the main process
runs that step's pipeline (the stage's inputs or gradients come from it), and the main process is
waiting for the answer, so the snapshot is exactly the state after step ``k``.

Shutdown: the main process sends "stop" to every server before its process group ends (a release hook
of :mod:`hasten.runtime.process_group`), and each server's process waits for its server to stop before
ending its own group, so no stage leaves while the main process may still ask. Every wait for a peer is
bounded by the run's collective bound (a dead peer closes its sockets, which ends a wait at once); only
the server's wait for the next request is unbounded (checkpoints may be hours apart).
"""

from __future__ import annotations

import io
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hasten.config.env import collective_timeout
from hasten.exceptions import CheckpointError
from hasten.runtime.process_group import add_before_end_hook, leaving_after_failure
from hasten.runtime.watchdog import DEFAULT_BOUND, process_group_timeout, running_bound
from hasten.strategies.pipeline_checkpoint import merged_optimizer_state, named_optimizer_state

#: Request codes (the first of a request's three numbers: code, optimizer step, optimizer index).
STOP, MODEL, OPTIMIZER = 0, 1, 2
#: How long a server waits for the next request: the main process saves when it likes, and a main
#: process that dies closes its sockets, which ends the wait at once.
_IDLE = timedelta(days=30)


class StepClock:
    """Counts this process's optimizer steps; a step holds the lock, so a snapshot never sees half of one.

    The optimizers' own step hooks take the lock and count (the prepared optimizer's step is unchanged).
    A step that raises keeps the lock: a later snapshot then fails at its bound, naming the step.
    """

    def __init__(self) -> None:
        self.condition = threading.Condition()
        self.steps = 0

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Hold the lock during each of ``optimizer``'s steps and count them."""
        optimizer.register_step_pre_hook(self._stepping)
        optimizer.register_step_post_hook(self._stepped)

    def _stepping(self, *_: Any) -> None:
        self.condition.acquire()

    def _stepped(self, *_: Any) -> None:
        self.steps += 1
        self.condition.notify_all()
        self.condition.release()

    def snapshot_at(self, step: int, read: Callable[[], Any], timeout: timedelta) -> Any:
        """``read()`` once this process has completed exactly ``step`` optimizer steps, under the lock.

        Raises:
            CheckpointError: the step was not reached within ``timeout``, or this process is past it.
        """
        with self.condition:
            if not self.condition.wait_for(lambda: self.steps >= step, timeout.total_seconds()):
                raise CheckpointError(f"this stage did not reach optimizer step {step} within "
                                      f"{timeout.total_seconds():g} s (it is at step {self.steps})")
            if self.steps != step:
                raise CheckpointError(f"this stage is at optimizer step {self.steps}, past the main process's {step}: "
                                      "the stages stepped their optimizers a different number of times")
            return read()


def _to_bytes(value: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return torch.frombuffer(buffer.getbuffer(), dtype=torch.uint8)  # the buffer's own bytes (no copy)


def _from_bytes(data: torch.Tensor) -> Any:
    # The bytes come from a process of this run over its private group, as torch's own
    # ``broadcast_object_list`` trusts them.
    return torch.load(io.BytesIO(data.numpy().tobytes()), map_location="cpu", weights_only=False)


class StageStateService:
    """The main process's side (:meth:`fetch`) or a stage's server of the state service (see the module).

    Args:
        group: the gloo group of the main process's pipeline (every process made it; this one is in it).
        main_rank: the main process's global rank.
        ranks: the group's global ranks.
        clock: this process's optimizer steps.
        state: what a server answers: ``state(code, optimizer_index)``, CPU tensors under full-model names.
        bound: the run's collective bound (every wait for a peer, but the idle one).
    """

    def __init__(self, group: Any, main_rank: int, ranks: list[int], clock: StepClock,
                 state: Callable[[int, int], Any], bound: timedelta) -> None:
        self.group, self.main_rank, self.clock, self.state, self.bound = group, main_rank, clock, state, bound
        self.is_main = dist.get_rank() == main_rank
        self.servers = [rank for rank in ranks if rank != main_rank]
        self._broken: str | None = None
        self._stopped = False
        self._thread: threading.Thread | None = None
        if not self.is_main:
            self._thread = threading.Thread(target=self._serve, name="hasten-pp-state-server", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------------------------- main process
    def fetch(self, code: int, index: int = 0) -> list[Any]:
        """Every server's answer to ``code`` for the optimizer step the main process has completed.

        Raises:
            CheckpointError: a server failed, did not answer within the bound, or the service stopped.
        """
        if self._broken is not None or self._stopped:
            raise CheckpointError(f"The pipeline stages' state service is unavailable: {self._broken or 'stopped'}.")
        request = torch.tensor([code, self.clock.steps, index], dtype=torch.int64)
        try:
            for rank in self.servers:  # every server serializes at once
                self._wait(dist.isend(request, dst=rank, group=self.group))
            answers = [self._answer(rank) for rank in self.servers]
        except RuntimeError as error:  # a peer gone or silent: the exchange cannot be resumed
            self._broken = f"a stage of ranks {self.servers} did not answer ({error})"
            raise CheckpointError(f"Reading the pipeline stages' state for the main process's save failed: "
                                  f"{error}") from error
        failed = [(rank, message) for rank, (ok, message) in zip(self.servers, answers) if not ok]
        if failed:
            raise CheckpointError("Reading the pipeline stages' state for the main process's save failed: " +
                                  "; ".join(f"rank {rank}: {message}" for rank, message in failed))
        return [value for _, value in answers]

    def _answer(self, rank: int) -> tuple[bool, Any]:
        header = torch.zeros(2, dtype=torch.int64)
        self._wait(dist.irecv(header, src=rank, group=self.group))
        ok, length = (int(v) for v in header)
        data = torch.empty(length, dtype=torch.uint8)
        self._wait(dist.irecv(data, src=rank, group=self.group))
        return bool(ok), _from_bytes(data)

    def _wait(self, work: Any, timeout: timedelta | None = None) -> None:
        work.wait(timeout=timeout or self.bound)

    # ------------------------------------------------------------------------------------------ servers
    def _serve(self) -> None:
        request = torch.zeros(3, dtype=torch.int64)
        try:
            while True:
                self._wait(dist.irecv(request, src=self.main_rank, group=self.group), _IDLE)
                code, step, index = (int(v) for v in request)
                if code == STOP:
                    return
                ok, payload = self._snapshot(code, step, index)
                self._wait(dist.isend(torch.tensor([ok, payload.numel()], dtype=torch.int64), dst=self.main_rank,
                                      group=self.group))
                self._wait(dist.isend(payload, dst=self.main_rank, group=self.group))
        except Exception as error:  # noqa: BLE001 - the main process left or the group ended: nothing to serve
            if not self._stopped:
                self._broken = str(error)
        finally:
            self._stopped = True

    def _snapshot(self, code: int, step: int, index: int) -> tuple[int, torch.Tensor]:
        """``(1, the state's bytes)`` after optimizer step ``step``, or ``(0, why not)``."""
        try:
            return 1, self.clock.snapshot_at(step, lambda: _to_bytes(self.state(code, index)), self.bound)
        except Exception as error:  # noqa: BLE001 - told to the main process, which raises it
            return 0, _to_bytes(f"{type(error).__name__}: {error}")

    # ----------------------------------------------------------------------------------------- shutdown
    def close(self) -> None:
        """Before the process group ends: the main process stops every server; a server's process waits for
        its server to be stopped (bounded), so it never leaves while the main process may still ask, unless
        it ends because of an error."""
        if self.is_main:
            if self._stopped:
                return
            self._stopped = True
            stop = torch.tensor([STOP, 0, 0], dtype=torch.int64)
            for rank in self.servers:
                try:
                    self._wait(dist.isend(stop, dst=rank, group=self.group))
                except RuntimeError:  # that server's process already left
                    pass
            return
        assert self._thread is not None
        if leaving_after_failure():  # the run is failing: do not delay the launcher's noticing it
            self._stopped = True
            return
        self._thread.join(self.bound.total_seconds())
        if self._thread.is_alive():
            self._stopped = True
            print(f"hasten: the main process did not stop this pipeline stage's state server within "
                  f"{self.bound.total_seconds():g} s of this process's end; leaving without waiting longer (a save "
                  "the main process starts now fails with the reason).", file=sys.stderr, flush=True)


def start_state_service(mesh: Any, clock: StepClock, state: Callable[[int, int], Any]) -> StageStateService | None:
    """On every process (it makes a group): the service of the main process's pipeline, or ``None`` on the
    processes outside it. Its ``close`` runs before the process group ends."""
    ranks = main_pipeline_ranks(mesh)
    bound = running_bound() or collective_timeout() or DEFAULT_BOUND
    group = dist.new_group(ranks, backend="gloo", timeout=process_group_timeout(bound))
    if dist.get_rank() not in ranks:
        return None
    service = StageStateService(group, ranks[0], ranks, clock, state, bound)
    add_before_end_hook(service.close)
    return service


class PipelineStates:
    """The pipeline strategy's side: started at ``prepare`` (unsharded stages), read by the main process's
    saves (:meth:`full_weights`, :meth:`optimizer_state`), answering as a server elsewhere."""

    def __init__(self) -> None:
        self.clock = StepClock()
        self.service: StageStateService | None = None
        self.started = False
        self.stage: nn.Module | None = None
        #: The prepared optimizers, in prepare order (a request names one by its position), and their layouts.
        self.optimizers: list[torch.optim.Optimizer] = []
        self.layouts: dict[int, Any] = {}

    def start(self, mesh: Any, stage: nn.Module, optimizers: list[torch.optim.Optimizer],
              layouts: dict[int, Any]) -> None:
        """At ``prepare``, on every process (the first call makes the service's group)."""
        self.stage, self.layouts = stage, layouts
        for optimizer in optimizers:
            if not any(optimizer is known for known in self.optimizers):
                self.clock.watch(optimizer)
                self.optimizers.append(optimizer)
        if not self.started:
            self.started = True
            self.service = start_state_service(mesh, self.clock, self._answer)

    def _answer(self, code: int, index: int) -> Any:
        """What this stage's server answers: its weights, or optimizer ``index``'s state, by full-model names."""
        assert self.stage is not None
        if code == MODEL:
            return self._stage_weights(self.stage)
        if code == OPTIMIZER:
            return named_optimizer_state(self.stage, self.optimizers[index])
        raise CheckpointError(f"unknown state request {code}")

    @staticmethod
    def _stage_weights(stage: nn.Module) -> dict[str, torch.Tensor]:
        return {key: value.detach().cpu() for key, value in stage.state_dict().items()}

    def _main(self) -> StageStateService | None:
        return self.service if self.service is not None and self.service.is_main else None

    def full_weights(self) -> dict[str, torch.Tensor] | None:
        """The full model's weights (this stage's and every server's) on the main process; else ``None``."""
        service = self._main()
        if service is None or self.stage is None:
            return None
        merged = self._stage_weights(self.stage)
        for part in service.fetch(MODEL):
            merged.update(part)
        return merged

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """On the main process, the full model's state of ``optimizer`` in one process's ``state_dict()``
        format; elsewhere, or for an optimizer prepared apart from the model, its own ``state_dict()``."""
        service, layout = self._main(), self.layouts.get(id(optimizer))
        index = next((i for i, known in enumerate(self.optimizers) if known is optimizer), None)
        if service is None or self.stage is None or index is None or not isinstance(layout, list):
            return optimizer.state_dict()
        parts = [named_optimizer_state(self.stage, optimizer), *service.fetch(OPTIMIZER, index)]
        return merged_optimizer_state(parts, optimizer.state_dict()["param_groups"], layout)


def main_pipeline_ranks(mesh: Any, main_rank: int = 0) -> list[int]:
    """The global ranks of the ``pp`` group that holds ``main_rank``, in stage order."""
    ranks = mesh.mesh
    pp = list(mesh.mesh_dim_names).index("pp")
    rows = ranks.movedim(pp, -1).reshape(-1, ranks.shape[pp])
    return [int(rank) for rank in rows[(rows == main_rank).any(dim=1)][0]]


__all__ = ["MODEL", "OPTIMIZER", "STOP", "PipelineStates", "StageStateService", "StepClock", "main_pipeline_ranks",
           "start_state_service"]
