"""Preemption on the Accelerator: arm the protocol at ``prepare``, answer ``preemption_requested``, save at the stop.

The protocol itself (signal, watcher thread, common stop step) lives in
:mod:`hasten.runtime.preemption`; the process group's owner starts and stops it.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

from hasten.accelerator._base import AcceleratorBase
from hasten.config import env as hasten_env
from hasten.runtime import process_group
from hasten.runtime.preemption import PREEMPTION

_Method = TypeVar("_Method", bound=Callable[..., Any])


def no_stop_inside(method: _Method) -> _Method:
    """Decorate a facade method whose collectives must not be a preemption boundary (saves, loads)."""
    @functools.wraps(method)
    def held(*args: Any, **kwargs: Any) -> Any:
        with PREEMPTION.held():
            return method(*args, **kwargs)
    return cast(_Method, held)


def _before_forward(module: Any, args: Any) -> None:
    PREEMPTION.before_forward()


class PreemptionMixin(AcceleratorBase):
    """``preemption_requested`` and the automatic checkpoint taken when a preemption signal arrives."""

    @property
    def preemption_requested(self) -> bool:
        """True on every process once the run was asked to stop (hasten; not in Accelerate).

        After ``hasten launch``'s preemption signal (SIGTERM by default) reaches any process, every
        process finishes the same optimizer step ``S`` and this becomes True right after it (in
        evaluation, with no step, before the same Accelerator collective on every process). With
        ``ProjectConfiguration(automatic_checkpoint_naming=True)`` hasten saves and exits by itself at
        the next batch of a prepared loader (without one: the next model forward, step or collective);
        otherwise check it at the end of the loop body (after ``optimizer.step()``,
        ``scheduler.step()`` and ``zero_grad()``), so the saved data position is exact. A loop that
        does neither exits there with code 75 and no checkpoint.

        Example:
            >>> for batch in loader:
            ...     ...  # forward, backward, optimizer.step(), scheduler.step(), optimizer.zero_grad()
            ...     if accelerator.preemption_requested:
            ...         accelerator.save_state("ckpt")
            ...         break
        """
        PREEMPTION.acknowledged = True  # the loop handles preemption itself: the signal must not end the process
        return PREEMPTION.requested

    def _arm_preemption(self) -> None:
        """Start listening for the preemption signal (at the first ``prepare`` of an optimizer)."""
        method = weakref.WeakMethod(self._preemption_checkpoint)
        accelerator = weakref.ref(self)

        def stop_action() -> Path | None:
            bound = method()
            return bound() if bound is not None else None

        def in_loader() -> bool:  # a prepared loader pass in progress: its next batch is the boundary
            this = accelerator()
            return this is not None and this.gradient_state.in_dataloader

        def watch_forwards() -> list[Any]:  # installed only once a boundary is due: free on normal steps
            this = accelerator()  # prepend: before FSDP's or DeepSpeed's own pre-forward gathers the parameters
            return [model.register_forward_pre_hook(_before_forward, prepend=True)
                    for model in (this._models if this else [])]

        process_group.watch_preemption(hasten_env.preemption_signal(), stop_action, hasten_env.preemption_dir(),
                                       in_loader=in_loader, watch_forwards=watch_forwards)

    def _preemption_checkpoint(self) -> Path | None:
        """Save the automatic checkpoint (every process), or None when the run has no project folder for one."""
        config = self.project_configuration  # type: ignore[attr-defined]
        if not (config.automatic_checkpoint_naming and self.project_dir):
            return None
        target: Path = self.save_state()  # type: ignore[attr-defined]
        self.wait_for_checkpoint()  # type: ignore[attr-defined]
        return target


__all__ = ["PreemptionMixin", "no_stop_inside"]
