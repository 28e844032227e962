"""How the model is replicated or sharded: the strategy interface and the single-device strategy."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hasten.base.dataclasses import DistributedType
from hasten.base.imports import is_compiled_module
from hasten.checkpointing import files as ckpt, restore_checks as checks
from hasten.checkpointing.sinks import Sink
from hasten.exceptions import ConfigurationError
from hasten.precision import Precision
from hasten.runtime import process_group


@dataclass
class CheckedState:
    """What :meth:`Strategy.check` read and validated, handed back to :meth:`Strategy.load`.

    Attributes:
        optimizer_states: one ``state_dict`` per optimizer that the facade loads itself, with an undo
            (empty when the strategy loads optimizer state as part of its own format).
        models: the strategy's own part (base: the model weights; sharded strategies: nothing, they
            read their folders in ``load``).
    """

    optimizer_states: list[Any] = field(default_factory=list)
    models: Any = None



def window_mean(loss: torch.Tensor, accumulation_steps: int) -> torch.Tensor:
    """The micro-batch's share of the accumulation window's mean loss: the one place the loss is divided."""
    return loss / accumulation_steps if accumulation_steps > 1 else loss


def plain_backward(loss: torch.Tensor, *, sync: bool = True, accumulation_steps: int = 1, **kwargs: Any) -> None:
    """:meth:`Strategy.backward` when neither strategy nor precision adds anything: the window mean's backward."""
    window_mean(loss, accumulation_steps).backward(**kwargs)


def plain_optimizer_step(optimizer: torch.optim.Optimizer, closure: Any = None) -> bool:
    """:meth:`Strategy.optimizer_step` with nothing to add (no loss scaler): the optimizer's step, never skipped."""
    if closure is None:
        optimizer.step()
    else:
        optimizer.step(closure)
    return True


def plain_zero_grad(optimizer: torch.optim.Optimizer, set_to_none: bool | None = None) -> None:
    """:meth:`Strategy.zero_grad` with nothing to add: the optimizer's own."""
    if set_to_none is None:
        optimizer.zero_grad()
    else:
        optimizer.zero_grad(set_to_none=set_to_none)



def write_single_process_files(folder: Path, weights: list[dict[str, torch.Tensor]],
                               optimizer_states: list[dict[str, Any]], safe_serialization: bool, sink: Sink) -> None:
    """The single-process checkpoint files: ``model{_i}`` from each non-empty ``weights`` entry and
    ``optimizer{_i}.bin`` from each optimizer state, all through ``sink``."""
    for i, state in enumerate(weights):
        if state:
            ckpt.save_model_weights(state, folder, i, safe_serialization, sink=sink)
    for i, state in enumerate(optimizer_states):
        ckpt.torch_save(state, folder / ckpt.OPTIMIZER.format(suffix=ckpt.suffix(i)), sink=sink)

class Strategy:
    """How models are replicated or sharded: the whole model path behind the ``Accelerator`` facade.

    The facade calls one method per concern and never asks what a strategy is: :meth:`prepare` (models
    and optimizers together), :meth:`backward`, :meth:`optimizer_step`, :meth:`no_sync`, clipping,
    :meth:`save`/:meth:`check`/:meth:`load` of model and optimizer state, :meth:`teardown`. The base
    class is the single-device behaviour; a strategy overrides what its engine does differently, and
    applies or clearly refuses every setting it is given.

    Args:
        device: the torch device of this process.
        precision: the precision plugin (chosen for this strategy by the connector).
        distributed_type: Accelerate's reporting value for this run.
        num_processes: processes in the run.
    """

    def __init__(self, device: torch.device, precision: Precision, distributed_type: DistributedType,
                 num_processes: int = 1) -> None:
        self.device = device
        self.precision = precision
        self.distributed_type = distributed_type
        self.num_processes = num_processes
        self._owns_group = False

    # ------------------------------------------------------------------------------ set-up, teardown
    def setup(self) -> None:
        """Register :meth:`release` to run before the process group ends (the facade calls this once)."""
        process_group.add_before_end_hook(self.release)

    def _ensure_group(self, backend: str | None = None) -> None:
        """Adopt the run's process group, or start (and own) a private one-rank group for one process."""
        if process_group.ensure_group(self.device, self.num_processes, backend):
            self._owns_group = True

    def release(self) -> None:
        """Drop what ties prepared models to the process group, before the group is destroyed.

        Called by ``end_training`` and at interpreter exit. Default: nothing to release.
        """

    def teardown(self) -> None:
        """Release the models' ties to the group, and end the private group this strategy started."""
        self.release()
        if self._owns_group:
            self._owns_group = False
            process_group.end_group()

    # ------------------------------------------------------------------------------------- prepare
    def observe_prepare_call(self, objects: Sequence[Any], *, split_batches: bool = False) -> None:
        """See every object of a ``prepare`` call before its models are prepared (default: nothing).

        DeepSpeed reads the data loaders' batch sizes and the schedulers here to fill its "auto" config.
        """

    def set_loss_fn(self, loss_fn: Callable[..., Any]) -> None:
        """Take ``prepare(..., loss_fn=...)``: only a strategy that computes the loss itself (pipeline) uses one.

        Raises:
            ConfigurationError: this strategy leaves the loss to the training loop.
        """
        raise ConfigurationError("prepare(..., loss_fn=...) is for pipeline-parallel runs (ParallelismConfig(pp_size=...) "
                                 "above 1), where the last stage computes the loss; here compute the loss in your loop "
                                 "and pass it to accelerator.backward.")

    def prepare(self, models: list[nn.Module], optimizers: list[torch.optim.Optimizer], *,
                device_placement: Sequence[bool], evaluation_mode: bool = False,
                accumulation_steps: int | None = None) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
        """Prepare the models of one ``prepare`` call together with its optimizers.

        Base: place each model, give its forward this run's precision, wrap it (:meth:`wrap_model`);
        the optimizers are returned as they are. Sharding strategies replace parameters and re-point
        the optimizers at them, or hand both to their engine.

        Args:
            models: the models, not yet prepared.
            optimizers: the raw optimizers of the same call.
            device_placement: per model, whether to move it to the device.
            evaluation_mode: for inference only (no wrapper).
            accumulation_steps: the Accelerator's gradient accumulation steps.

        Returns:
            The prepared models and the (raw) optimizers to use, in the same order.
        """
        prepared = []
        for model, placement in zip(models, device_placement):
            if placement:
                model = model.to(self.device)
            self.apply_precision(model)
            prepared.append(model if evaluation_mode else self.wrap_model(model))
        return prepared, optimizers

    def place_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Move the optimizer's per-parameter state to this process's device (``device_placement``)."""
        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.device != self.device and key != "step":
                    state[key] = value.to(self.device)

    def compile(self, model: nn.Module, backend: str, options: dict[str, Any]) -> nn.Module:
        """``torch.compile`` the prepared model (the facade calls it once, after :meth:`prepare`)."""
        compiled: nn.Module = torch.compile(model, backend=backend, **options)  # type: ignore[assignment]
        return compiled

    def accumulation_steps(self, requested: int) -> int:
        """Micro-steps per optimizer step this strategy uses, given the Accelerator's ``requested`` count.

        Called by the facade after ``prepare``; an engine with its own configured count (DeepSpeed)
        returns that one, and the facade adopts it.
        """
        return requested

    def apply_precision(self, model: nn.Module) -> None:
        """Give the model this run's mixed precision: its layers converted (fp8), then a forward under
        autocast returning fp32 outputs."""
        self.precision.convert_module(model)
        if self.precision.native_amp:
            self.precision.wrap_forward(model)

    def wrap_model(self, model: nn.Module, *, evaluation_mode: bool = False) -> nn.Module:
        """Wrap an already placed model for this strategy (the single-device strategy keeps it)."""
        return model

    def is_wrapped(self, model: nn.Module) -> bool:
        """True when ``model`` is already this strategy's wrapper."""
        return False

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside any wrapper of this strategy (and torch.compile)."""
        return unwrap_common(model)

    def model_state_dict(self, model: nn.Module, *, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The full state dict of ``model`` (called on every process; sharded strategies gather)."""
        return (self.unwrap(model) if unwrap else model).state_dict()

    # ------------------------------------------------------------------------------------ the step
    def backward(self, loss: torch.Tensor, *, sync: bool = True, accumulation_steps: int = 1, **kwargs: Any) -> None:
        """Backward pass through the precision plugin.

        Args:
            loss: the micro-batch's loss; divided here by ``accumulation_steps`` (when above 1) so the
                accumulated gradient is the mean over the window.
            sync: True on a synchronising micro-step (the facade's ``sync_gradients``).
            accumulation_steps: micro-steps per optimizer step.
            **kwargs: passed to ``Tensor.backward``.
        """
        self.precision.backward(window_mean(loss, accumulation_steps), **kwargs)

    def backward_fn(self) -> Callable[..., None]:
        """What the facade calls for each micro-step's backward, with :meth:`backward`'s signature; asked once.

        :func:`plain_backward` (the window mean, then ``loss.backward``) when :meth:`direct_backward`
        holds: two Python frames fewer on every step of an overhead-bound loop, and the accumulation
        rule stays here. Otherwise this strategy's own :meth:`backward`.
        """
        return plain_backward if self.direct_backward() else self.backward

    def optimizer_step_fn(self) -> Callable[..., bool]:
        """What the prepared optimizer calls to step, with :meth:`optimizer_step`'s signature; asked once.

        :func:`plain_optimizer_step` when :meth:`direct_optimizer_step` holds, else :meth:`optimizer_step`.
        """
        return plain_optimizer_step if self.direct_optimizer_step() else self.optimizer_step

    def zero_grad_fn(self) -> Callable[..., None]:
        """What the prepared optimizer calls to clear gradients (:func:`plain_zero_grad` on the direct path)."""
        return plain_zero_grad if self.direct_optimizer_step() else self.zero_grad

    def direct_backward(self) -> bool:
        """True when :meth:`backward` is exactly ``loss.backward(**kwargs)`` after the accumulation division.

        The facade then makes that call itself: two Python frames fewer on every step of an
        overhead-bound loop. Answered from the classes, so a strategy or precision overriding
        ``backward`` is never bypassed.
        """
        return type(self).backward is Strategy.backward and self.precision.direct_backward()

    def direct_optimizer_step(self) -> bool:
        """True when :meth:`optimizer_step` and :meth:`zero_grad` are exactly the optimizer's own calls.

        The prepared optimizer then calls ``optimizer.step()`` / ``zero_grad()`` itself (see
        :meth:`direct_backward` for why).
        """
        return (type(self).optimizer_step is Strategy.optimizer_step and type(self).zero_grad is Strategy.zero_grad
                and self.precision.direct_optimizer_step())

    def optimizer_state_to_load(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``state_dict`` in the form ``optimizer`` (prepared by this strategy) loads; the prepared
        optimizer's ``load_state_dict`` passes its argument through here. Unchanged by default."""
        return state_dict

    def optimizer_state_to_save(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """What the prepared optimizer's public ``state_dict()`` returns for ``optimizer`` (prepared by this
        strategy): its own ``state_dict()`` by default."""
        return optimizer.state_dict()

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any = None) -> bool:
        """Apply the update through the precision; False when it was skipped (fp16 overflow)."""
        return self.precision.optimizer_step(optimizer, closure)

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool | None = None) -> None:
        """Clear the optimizer's gradients (after a synchronising step)."""
        plain_zero_grad(optimizer, set_to_none)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the loss scale (before clipping)."""
        self.precision.unscale_(optimizer)

    def no_sync(self, model: nn.Module) -> Any:
        """Context in which backward passes do not synchronise gradients."""
        return nullcontext()

    @contextmanager
    def trigger_sync_in_backward(self, model: nn.Module) -> Iterator[None]:
        """Force a gradient sync in the next backward even inside ``no_sync``."""
        yield

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients (already unscaled) by total norm; returns the norm before clipping."""
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        """Clip gradients (already unscaled) element-wise."""
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    # ---------------------------------------------------------------------------------- checkpoints
    def weights_for_save(self, models: list[nn.Module]) -> list[dict[str, torch.Tensor]]:
        """The full weights ``save`` will write, shown to the save pre-hooks first (which may edit them).

        Every process calls it. Strategies that write their own (sharded) format return ``[]``.
        """
        return [self.model_state_dict(model) for model in models]

    def engine_checkpoint_kwargs(self, call: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Check the extra keyword arguments of ``save_state``/``load_state`` (``call``); returns them.

        Accelerate hands them to an engine that writes its own checkpoint (DeepSpeed's
        ``save_checkpoint``/``load_checkpoint``); elsewhere it ignores them. No engine here reads
        them, so any is refused rather than dropped.

        Raises:
            ConfigurationError: names the arguments and the fix.
        """
        if kwargs:
            engine_call = "save_checkpoint" if call == "save_state" else "load_checkpoint"
            own = " (load_state's own are strict, map_location, verify_checksums)" if call == "load_state" else ""
            raise ConfigurationError(
                f"{call}() got keyword arguments it does not use: {', '.join(sorted(kwargs))}. Accelerate passes "
                f"extra {call} arguments only to DeepSpeed's engine.{engine_call}, and this run does not use "
                f"DeepSpeed: remove them{own}.")
        return {}

    def save(self, models: list[nn.Module], optimizers: list[torch.optim.Optimizer], folder: Path, *,
             weights: list[dict[str, torch.Tensor]], writer: bool, safe_serialization: bool = True,
             sink: Sink, engine_kwargs: Mapping[str, Any] | None = None) -> None:
        """Write model and optimizer state into ``folder`` (every process calls it).

        Base: the process that writes the shared files (``writer``) saves ``model{_i}.safetensors``
        (or ``pytorch_model{_i}.bin``) from ``weights`` and ``optimizer{_i}.bin``. A state a pre-hook
        emptied is not written (the hook saved it). Files written through
        :mod:`hasten.checkpointing.files` go to ``sink``, the save's (:mod:`hasten.checkpointing.sinks`:
        sealed as each is written, or staged for an asynchronous save); files an engine writes itself
        are checksummed when the save is published.
        ``engine_kwargs``: what :meth:`engine_checkpoint_kwargs` accepted (base: none).
        """
        self.engine_checkpoint_kwargs("save_state", engine_kwargs or {})
        if writer:
            write_single_process_files(folder, weights, [opt.state_dict() for opt in optimizers],
                                       safe_serialization, sink)

    def check(self, models: list[nn.Module], optimizers: list[torch.optim.Optimizer], folder: Path, *,
              strict: bool = True, map_location: Any = "cpu") -> CheckedState:
        """Read and check what :meth:`save` wrote, before anything is loaded; returns it for :meth:`load`.

        Base: the model weights and the optimizer states, each checked against its model/optimizer.
        The facade applies ``optimizer_states`` itself (with the other small states, each undoable).

        Raises:
            CheckpointError: a missing or damaged file, or a state that does not match.
        """
        weights = []
        for i, model in enumerate(models):
            path, state = ckpt.read_model_weights(folder, i)
            ckpt.check_model_weights(self.unwrap(model), state, path, strict=strict)
            weights.append(state)
        optimizer_states = []
        for i, optimizer in enumerate(optimizers):
            path = folder / ckpt.OPTIMIZER.format(suffix=ckpt.suffix(i))
            optimizer_states.append(ckpt.torch_load(path, map_location))
            checks.check_optimizer_state(optimizer, optimizer_states[-1], path)
        return CheckedState(optimizer_states=optimizer_states, models=weights)

    def load(self, models: list[nn.Module], optimizers: list[torch.optim.Optimizer], folder: Path,
             checked: CheckedState, *, strict: bool = True, engine_kwargs: Mapping[str, Any] | None = None) -> None:
        """Load the strategy's part of what :meth:`check` returned (base: the model weights).

        Called on every process, after the facade applied ``checked.optimizer_states`` and the other
        small states (model state is loaded last: it cannot be undone cheaply). ``engine_kwargs``:
        what :meth:`engine_checkpoint_kwargs` accepted (base: none).
        """
        self.engine_checkpoint_kwargs("load_state", engine_kwargs or {})
        for model, state in zip(models, checked.models):
            ckpt.load_model_weights(self.unwrap(model), state, strict=strict)

    def accumulated_gradients(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """This process's gradients gathered so far in an accumulation window (a save mid-window).

        Raises:
            CheckpointError: the strategy cannot capture them (the save is refused before anything is written).
        """
        return {name: p.grad.detach().cpu().contiguous() for name, p in self.unwrap(model).named_parameters()
                if p.grad is not None}

    def restore_accumulated_gradients(self, model: nn.Module, grads: dict[str, torch.Tensor], path: Path) -> None:
        """Put back what :meth:`accumulated_gradients` captured (``path`` names the file in errors)."""
        ckpt.restore_gradients(self.unwrap(model), grads, path)


class SingleDeviceStrategy(Strategy):
    """One process: nothing to replicate."""


def unwrap_common(model: nn.Module) -> nn.Module:
    """Strip torch.compile's and DDP-like ``.module`` wrappers."""
    while True:
        if hasattr(model, "_orig_mod") and is_compiled_module(model):
            model = model._orig_mod
        elif isinstance(model, nn.parallel.DistributedDataParallel) or type(model).__name__ == "DeepSpeedEngine":
            model = model.module  # type: ignore[assignment]
        else:
            return model
