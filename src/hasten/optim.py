"""Optimizer and scheduler wrappers that follow gradient accumulation and fp16 loss scaling.

``AcceleratedOptimizer.step``/``zero_grad`` do nothing on micro-steps where gradients are not
synchronised (inside ``accelerator.accumulate``), so the ordinary loop needs no ``if``. With fp16 the
step goes through the GradScaler; a step whose gradients overflowed is skipped and
``step_was_skipped`` says so.

**Scheduler stepping (read this if you compute schedule lengths yourself).** Like Accelerate,
``AcceleratedScheduler.step()`` advances the wrapped scheduler ``num_processes`` times per optimizer
step, because each step consumed ``num_processes`` batches: a schedule written for a single-process
run over the whole data set then ends at the same point. Build the scheduler with
``num_training_steps * num_processes`` if you count optimizer steps per process, or pass
``Accelerator(step_scheduler_with_optimizer=False)`` and step it yourself. Schedulers without a step
count (``ReduceLROnPlateau``) are never multiplied.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from hasten.base.dataclasses import DistributedType
from hasten.logging import get_logger
from hasten.precision import FP16Precision, Precision
from hasten.runtime.preemption import PREEMPTION as _PREEMPTION
from hasten.state import AcceleratorState, GradientState
from hasten.strategies import SingleDeviceStrategy, Strategy

logger = get_logger(__name__)


class AcceleratedOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer for accumulation; the step itself goes through the strategy and its precision.

    Args:
        optimizer: the user's optimizer.
        device_placement: whether its state was placed on the device (Accelerate's attribute).
        scaler: the fp16 GradScaler, if any (Accelerate's attribute; the precision plugin uses it).
        strategy: the strategy that applies the step (``accelerator.prepare`` passes it); without
            one, a single-device strategy on the CPU whose precision uses ``scaler``.

    Example:
        >>> model, optimizer = accelerator.prepare(model, optimizer)
        >>> optimizer.step()  # a no-op while accumulating
    """

    def __init__(self, optimizer: torch.optim.Optimizer, device_placement: bool = True, scaler: Any = None,
                 strategy: Strategy | None = None) -> None:
        self.optimizer = optimizer
        self.scaler = scaler
        if strategy is None:  # built by hand: step through this scaler, if any
            precision = Precision("cpu")
            if scaler is not None:
                precision = FP16Precision(str(getattr(scaler, "_device", "cpu")))
                precision.scaler = scaler
            precision.setup_optimizer(optimizer)
            strategy = SingleDeviceStrategy(torch.device("cpu"), precision, DistributedType.NO)
        self._strategy = strategy
        # The strategy's step and zero_grad (plain functions when it adds nothing): asked once.
        self._step, self._zero_grad = strategy.optimizer_step_fn(), strategy.zero_grad_fn()
        self._direct = strategy.direct_optimizer_step()  # its steps are never skipped (read by the scheduler)
        self.gradient_state = GradientState()
        self.device_placement = device_placement
        self._is_overflow = False

    #: fault tolerance (``hasten.fault_tolerance.replica.ReplicaGroup``): the step waits for the quorum's commit
    _replica_group: Any = None

    # Forwarded attributes -------------------------------------------------------------------------
    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def param_groups(self) -> Any:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: Any) -> None:
        self.optimizer.param_groups = value

    @property
    def defaults(self) -> Any:  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: Any) -> None:
        self.optimizer.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        # The strategy may re-index it (under pp_size > 1 a state saved over the full model, as one
        # process saves it, onto this stage's parameters).
        self.optimizer.load_state_dict(self._strategy.optimizer_state_to_load(self.optimizer, state_dict))

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        # The strategy may widen it (under pp_size > 1, on the main process: the full model's state, as one
        # process has it, which transformers' Trainer writes from the main process alone).
        return self._strategy.optimizer_state_to_save(self.optimizer)

    # torch's hook registration: the wrapped optimizer runs them (its ``step``, ``state_dict`` and
    # ``load_state_dict`` are what this wrapper calls), so they are registered there. Memory trackers and
    # profilers (torch.distributed._tools) register step hooks on the optimizer they are handed.
    def register_step_pre_hook(self, hook: Any) -> RemovableHandle:
        """Run ``hook(optimizer, args, kwargs)`` before each real step of the wrapped optimizer (not on
        accumulation micro-steps, nor on fp16 steps skipped for overflow). Returns a handle whose
        ``remove()`` unregisters it."""
        return self._wrapped_hook_registration("register_step_pre_hook")(hook)

    def register_step_post_hook(self, hook: Any) -> RemovableHandle:
        """Run ``hook(optimizer, args, kwargs)`` after each real step of the wrapped optimizer."""
        return self._wrapped_hook_registration("register_step_post_hook")(hook)

    def register_state_dict_pre_hook(self, hook: Any, prepend: bool = False) -> RemovableHandle:
        """Run ``hook(optimizer)`` before ``state_dict()`` (torch's signature)."""
        return self._wrapped_hook_registration("register_state_dict_pre_hook")(hook, prepend=prepend)

    def register_state_dict_post_hook(self, hook: Any, prepend: bool = False) -> RemovableHandle:
        """Run ``hook(optimizer, state_dict)`` after ``state_dict()``; it may return a replacement."""
        return self._wrapped_hook_registration("register_state_dict_post_hook")(hook, prepend=prepend)

    def register_load_state_dict_pre_hook(self, hook: Any, prepend: bool = False) -> RemovableHandle:
        """Run ``hook(optimizer, state_dict)`` before ``load_state_dict()``; it may return a replacement."""
        return self._wrapped_hook_registration("register_load_state_dict_pre_hook")(hook, prepend=prepend)

    def register_load_state_dict_post_hook(self, hook: Any, prepend: bool = False) -> RemovableHandle:
        """Run ``hook(optimizer)`` after ``load_state_dict()``."""
        return self._wrapped_hook_registration("register_load_state_dict_post_hook")(hook, prepend=prepend)

    def _wrapped_hook_registration(self, method: str) -> Any:
        register = getattr(self.optimizer, method, None)
        if register is None:
            raise AttributeError(f"{type(self.optimizer).__name__} (the optimizer this AcceleratedOptimizer wraps) has "
                                 f"no {method}(): it is not a torch.optim.Optimizer, or its torch is too old. HINT: "
                                 "register the hook through the object that steps it, or use a torch optimizer.")
        return register

    def train(self) -> None:
        """Forward ``train()`` to optimizers that have one (schedule-free)."""
        if hasattr(self.optimizer, "train"):
            self.optimizer.train()

    def eval(self) -> None:
        """Forward ``eval()`` to optimizers that have one (schedule-free)."""
        if hasattr(self.optimizer, "eval"):
            self.optimizer.eval()

    # The training step -----------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool | None = None) -> None:  # type: ignore[override]
        """Clear gradients, only on synchronising steps (accumulated gradients survive otherwise)."""
        if self.gradient_state.sync_gradients:
            self._zero_grad(self.optimizer, set_to_none)

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Apply the update on synchronising steps; with fp16, skip it when gradients overflowed.

        Returns the closure's loss when one is given (its first evaluation, as torch's optimizers do).
        """
        if not self.gradient_state.sync_gradients:
            return None
        if _PREEMPTION.pending:  # preemption: after step S, outside a loader pass, the next step is a boundary
            _PREEMPTION.before_step()
        if self._replica_group is not None and not self._replica_group.commit(
                [p for group in self.optimizer.param_groups for p in group["params"]]):
            self._is_overflow = True  # replica groups: the quorum did not commit; the step is retried
            return None
        losses: list[Any] = []
        if closure is None:
            self._is_overflow = not self._step(self.optimizer)
        else:
            def recording_closure() -> Any:
                loss = closure()
                losses.append(loss)
                return loss

            self._is_overflow = not self._step(self.optimizer, recording_closure)
        # Preemption (see hasten.runtime.preemption): one increment and one flag read per step.
        _PREEMPTION.steps += 1
        if _PREEMPTION.pending:
            _PREEMPTION.after_step()
        return losses[0] if losses else None

    @property
    def step_was_skipped(self) -> bool:
        """True when the last ``step`` was skipped: fp16 gradients held inf/NaN, or the replica groups' quorum
        did not commit it."""
        return self._is_overflow

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("gradient_state", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_direct", False)  # pickled before the direct path existed: the general one
        if "_step" not in self.__dict__:
            self._step, self._zero_grad = self._strategy.optimizer_step, self._strategy.zero_grad
        self.gradient_state = GradientState()


class AcceleratedScheduler:
    """Steps a learning-rate scheduler only when its optimizers really stepped.

    Args:
        scheduler: the user's scheduler.
        optimizers: the prepared optimizers it follows.
        step_with_optimizer: step once per process per optimizer step (Accelerate's default), see the
            module docstring; False steps exactly when you call ``step()``.
        split_batches: batches are split, not multiplied, across processes: step once.
    """

    def __init__(self, scheduler: Any, optimizers: Any, step_with_optimizer: bool = True,
                 split_batches: bool = False) -> None:
        self.scheduler = scheduler
        self.optimizers = optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]
        self.split_batches = split_batches
        self.step_with_optimizer = step_with_optimizer
        self.gradient_state = GradientState()
        # Read once, on the first step: AcceleratorState's process attributes resolve through a slow
        # __getattr__ chain (~9 us a read), and the count cannot change during a run.
        self._num_processes: int | None = None
        # Fixed by the scheduler's type, so decided here rather than on every step: whether the schedule is
        # stepped once (ReduceLROnPlateau, or no step count to multiply).
        self._step_once = not hasattr(scheduler, "get_last_lr") or _is_plateau(scheduler)

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Advance the schedule (see the class docstring for how many times)."""
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.gradient_state.sync_gradients:
            if self.gradient_state.adjust_scheduler:
                self.scheduler._step_count += 1
            return
        for opt in self.optimizers:  # every one: code (and Accelerate's tests) may set `_is_overflow` itself
            if getattr(opt, "step_was_skipped", False):
                return
        scheduler = self.scheduler
        if self.split_batches or self._step_once:
            scheduler.step(*args, **kwargs)
            return
        for _ in range(self._steps_per_optimizer_step()):
            total = getattr(scheduler, "total_steps", None)
            if total is None or scheduler._step_count <= total:  # OneCycleLR raises past its end
                scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> Any:
        return self.scheduler.get_last_lr()

    def _multiplies(self) -> bool:
        return self.step_with_optimizer and not self.split_batches and not self._step_once

    def _steps_per_optimizer_step(self) -> int:
        if self._num_processes is None:
            self._num_processes = int(AcceleratorState().num_processes)
        return self._num_processes

    def state_dict(self) -> dict[str, Any]:
        """The wrapped scheduler's state, plus how many times it advances per optimizer step (see
        :meth:`load_state_dict`)."""
        state = self.scheduler.state_dict()
        if self._multiplies():
            state = {**state, _RATE_KEY: self._steps_per_optimizer_step()}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the schedule. A checkpoint saved on another number of processes keeps its rate: the
        schedule advanced ``saved processes`` times per optimizer step, and goes on doing so, so a run
        resumed on M processes with the same global batch follows the uninterrupted run's learning rates
        exactly (stepping M times would run the schedule M/N times faster from the resume on)."""
        state = dict(state_dict)
        saved_rate = state.pop(_RATE_KEY, None)
        self.scheduler.load_state_dict(state)
        if saved_rate is None or not self._multiplies():
            return
        current = self._steps_per_optimizer_step()
        if int(saved_rate) != current:
            logger.warning("The learning-rate schedule was saved by %d processes and steps %d times per optimizer "
                           "step; it keeps that rate on %d processes, so the schedule follows optimizer steps as "
                           "before the resume.", saved_rate, saved_rate, current)
            self._num_processes = int(saved_rate)

    def get_lr(self) -> Any:
        return self.scheduler.get_lr()

    def print_lr(self, *args: Any, **kwargs: Any) -> Any:
        return self.scheduler.print_lr(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in ("scheduler", "__setstate__", "__getstate__"):
            raise AttributeError(name)
        return getattr(self.scheduler, name)


#: Key of AcceleratedScheduler's own entry in the saved scheduler state (popped before the wrapped
#: scheduler sees it).
_RATE_KEY = "_hasten_steps_per_optimizer_step"


def _is_plateau(scheduler: Any) -> bool:
    return isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


class DeepSpeedOptimizerWrapper(AcceleratedOptimizer):
    """A DeepSpeed optimizer as Accelerate hands it out: ``step`` and ``zero_grad`` do nothing (the engine
    does both inside its step, see ``DeepSpeedEngineWrapper``); ``step_was_skipped`` reports the engine's
    fp16 overflow.

    Args:
        optimizer: the optimizer the DeepSpeed engine steps.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer, device_placement=False, scaler=None)

    def zero_grad(self, set_to_none: bool | None = None) -> None:  # type: ignore[override]
        """Nothing: the engine zeroes the gradients inside its step."""

    def step(self) -> None:  # type: ignore[override]
        """Nothing: the engine steps the optimizer inside its own step."""

    @property
    def step_was_skipped(self) -> bool:
        """Whether the engine's last step overflowed (fp16) and was skipped."""
        return bool(getattr(self.optimizer, "overflow", False))


class DeepSpeedSchedulerWrapper(AcceleratedScheduler):
    """A scheduler that the DeepSpeed engine steps itself: ``step`` does nothing (Accelerate's name).

    Transformers' ``Trainer`` checks ``isinstance(scheduler, DeepSpeedSchedulerWrapper)`` to decide whether
    DeepSpeed saved the scheduler with its engine.

    Args:
        scheduler: the scheduler handed to the engine.
        optimizers: the optimizers it follows.
    """

    def __init__(self, scheduler: Any, optimizers: Any) -> None:
        super().__init__(scheduler, optimizers)

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Nothing: the engine steps the scheduler inside its own step."""


__all__ = ["AcceleratedOptimizer", "AcceleratedScheduler", "DeepSpeedOptimizerWrapper", "DeepSpeedSchedulerWrapper"]
