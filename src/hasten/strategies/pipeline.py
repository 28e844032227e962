"""Pipeline-parallel training on ``torch.distributed.pipelining``, inside the ordinary training loop.

``ParallelismConfig(pp_size=P, pp_split_points=[...], pp_schedule="1F1B", pp_microbatches=M)``: each of the
``P`` processes holds one stage (the model with the other stages' modules made no-ops, names kept:
:mod:`hasten.strategies.pipeline_split`). The prepared model's call runs the whole step::

    loss = model(inputs, labels=labels)   # forward and backward of M micro-batches, on every process
    accelerator.backward(loss)            # checks the loss came from the pipeline; nothing else
    optimizer.step(); optimizer.zero_grad()

Schedules with several stages per process (interleaved, looped, zero-bubble, V-shaped) cut the
process's model into views that share its modules: :mod:`hasten.strategies.pipeline_schedules`.

Numerics: each micro-batch's loss is divided by ``M`` (and by the accumulation steps) before its
backward and the schedule's own scaling is off (``scale_grads=False``), so the gradients are those of
the mean of the micro-batch losses, as a single process computes them for a mean loss over equal
micro-batches. A call with ``num_items_in_batch=n`` (transformers' convention for a loss summed over
tokens and divided by the batch's count) passes ``n`` to the loss and does not divide by ``M``. The
returned loss (unscaled by accumulation) is sent from the last stage to every stage (one broadcast of
one number per step).

With ``dp_replicate_size=R`` as well (PP x DDP, mesh ``(pp, dp_replicate)``), each replica reads its own
share of the data, and a synchronising micro-step averages each stage's gradients over its replicas in
``accelerator.backward`` (one all-reduce of the stage's flattened gradients), where DDP would; the
returned loss is the replica's own, as under DDP.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hasten.checkpointing import dcp as sharded, files as ckpt, restore_checks as checks
from hasten.checkpointing.sinks import Sink
from hasten.config.parallelism import PP_MULTI_STAGE, PP_SCHEDULES, ParallelismConfig
from hasten.exceptions import CheckpointError, ConfigurationError
from hasten.ops.tree import find_batch_size
from hasten.strategies import pipeline_hf
from hasten.strategies.base import CheckedState, Strategy, unwrap_common, write_single_process_files
from hasten.strategies.pipeline_checkpoint import (
    check_shapes,
    check_sharded,
    checked_layout,
    full_optimizer_state,
    full_weights,
    load_full_into_sharded,
    load_sharded,
    optimizer_layout,
    optimizer_state_for_stage,
    save_sharded,
    stage_optimizer_state,
)
from hasten.strategies.pipeline_nd import (
    check_sharded_schedule,
    full_value,
    local_part,
    shard_stage,
    shards_stages,
)
from hasten.strategies.pipeline_schedules import (
    StageCall,
    call_shapes,
    check_divisible,
    check_schedule,
    cut_stages,
    forward_only_schedule,
    local_stages,
    own_loss,
    stage_ranks,
    takes_num_items,
)
from hasten.strategies.pipeline_split import cut_stage
from hasten.strategies.pipeline_state_service import PipelineStates

#: ``CheckedState.models`` of a DCP checkpoint: :meth:`PipelineStrategy.load` reads the shards itself.
_DCP = "dcp"


class PipelinedModel(nn.Module):
    """The prepared model under pipeline parallelism: calling it runs the pipelined forward and backward.

    ``module`` is this process's stage (the user's model with the other stages' modules made no-ops);
    ``call`` replaces the runner's step for models with their own calling conventions (transformers).
    """

    def __init__(self, module: nn.Module, runner: _PipelineRunner,
                 call: Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], Any] | None = None) -> None:
        super().__init__()
        self.module = module
        self._runner = runner
        self._call = call if call is not None else runner.step

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the whole step on this batch; returns the batch's mean loss (on every process)."""
        return self._call(self.module, args, kwargs)


class _PipelineRunner:
    """This process's stages, their schedules and the step around them: micro-batch losses, the loss on
    every process.

    torch's stage learns the shapes it exchanges from its first micro-batch and keeps them, so each
    distinct set of input shapes (a smaller last batch, another sequence length, evaluation) gets its
    own stages and schedule over the same modules, built at the first call that has those shapes. Every
    process holds the batch, so all of them pick the same one without a collective.
    """

    def __init__(self, module: nn.Module, stage_modules: dict[int, nn.Module], config: ParallelismConfig, mesh: Any,
                 device: torch.device, loss_fn: Callable[..., Any] | None, accumulation_steps: int) -> None:
        self.pp_size, self.microbatches = int(config.pp_size), config.pipeline_microbatches  # type: ignore[arg-type]
        self.schedule_name = str(config.pp_schedule)
        self.module = module
        self.stage_modules = stage_modules
        self.num_stages = self.pp_size * len(stage_modules)
        self.group = mesh["pp"].get_group()
        self.owners = stage_ranks(self.schedule_name, self.pp_size, self.num_stages)
        self.last_rank = dist.get_global_rank(self.group, self.owners[self.num_stages - 1])
        #: What torch's stages call: each stage's module given only its own inputs.
        self.stage_calls = {index: StageCall(module, index == 0,
                                             self._last_stage_kwargs if index == self.num_stages - 1 else None)
                            for index, module in stage_modules.items()}
        self.user_loss_fn = loss_fn
        self._loss_takes_items = loss_fn is None or takes_num_items(loss_fn)
        self.accumulation_steps = accumulation_steps
        self.device = device
        self.schedules: dict[tuple[Any, ...], Any] = {}
        #: ``num_items_in_batch`` of the step in progress (``None``: each micro-batch's loss is a mean).
        self._num_items: Any = None
        #: The loss the last step returned (what ``accelerator.backward`` accepts).
        self.last_loss: torch.Tensor | None = None
        #: Called with that loss in ``accelerator.backward`` (transformers models: loss scale, tied weights).
        self.backward_hooks: list[Callable[[torch.Tensor], None]] = []
        #: Say whether a loss other than ``last_loss`` was computed from the last call's outputs.
        self.loss_owners: list[Callable[[torch.Tensor], bool]] = []

    @property
    def is_first(self) -> bool:
        """This process holds the pipeline's first stage (it reads the model's inputs)."""
        return 0 in self.stage_modules

    @property
    def is_last(self) -> bool:
        """This process holds the last stage (it computes the loss)."""
        return self.num_stages - 1 in self.stage_modules

    def _micro_batch_loss(self, output: Any, target: Any) -> torch.Tensor:
        """The loss the schedule backpropagates for one micro-batch: its share of the window's loss.

        A mean loss is divided by the micro-batches and the accumulation steps (the window's mean); a loss
        already normalised by ``num_items_in_batch`` (the whole batch's count) only by the accumulation
        steps, as ``accelerator.backward`` divides any loss.
        """
        if self.user_loss_fn is None:
            raw = own_loss(output)
        elif self._num_items is None:
            raw = self.user_loss_fn(output, target)
        else:
            raw = self.user_loss_fn(output, target, num_items_in_batch=self._num_items)
        shares = self.accumulation_steps * (1 if self._num_items is not None else self.microbatches)
        return raw / shares  # type: ignore[no-any-return]

    def _last_stage_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The last stage's keyword arguments: the labels (and the item count) when the model computes its loss."""
        if self.user_loss_fn is not None or "labels" not in kwargs:
            return {}
        extra = {} if self._num_items is None else {"num_items_in_batch": self._num_items}
        return {"labels": kwargs["labels"], **extra}

    def _schedule(self, training: bool, args: tuple[Any, ...], kwargs: dict[str, Any], labels: Any) -> Any:
        """The schedule for these input shapes (training: with the loss and backward; else forward only)."""
        from torch.distributed import pipelining

        key = (training, *call_shapes(args), *call_shapes(kwargs), *call_shapes(labels))
        if key not in self.schedules:
            stages = [pipelining.PipelineStage(call, index, self.num_stages, self.device, group=self.group)
                      for index, call in self.stage_calls.items()]
            schedule_class = getattr(pipelining, PP_SCHEDULES[self.schedule_name])
            if self.schedule_name in PP_MULTI_STAGE and not training:
                self.schedules[key] = forward_only_schedule(self.schedule_name, stages, self.owners, self.microbatches)
            elif self.schedule_name in PP_MULTI_STAGE:
                self.schedules[key] = schedule_class(stages, n_microbatches=self.microbatches,
                                                     loss_fn=self._micro_batch_loss, scale_grads=False)
            elif training:
                self.schedules[key] = schedule_class(stages[0], n_microbatches=self.microbatches,
                                                     loss_fn=self._micro_batch_loss, scale_grads=False)
            else:
                # scale_grads=False: torch's GPipe divides the held gradients by the micro-batches even without a loss.
                self.schedules[key] = pipelining.ScheduleGPipe(stages[0], n_microbatches=self.microbatches,
                                                               scale_grads=False)
        return self.schedules[key]

    def step(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        """Forward and backward of one batch through every stage; the batch's loss on every process.

        The loss is the mean of the micro-batches' losses, or, when the call carries
        ``num_items_in_batch`` (transformers' convention), the sum of the micro-batches' losses, each
        already divided by that count. In evaluation (``model.eval()`` or ``torch.no_grad()``): forward
        only, returning the last stage's output on every process, or ``loss_fn(output, labels)`` when
        labels are given.
        """
        labels = kwargs.pop("labels", None)
        self._num_items = kwargs.pop("num_items_in_batch", None)
        training = torch.is_grad_enabled() and module.training
        batch_size = self._check_call(training, args, kwargs, labels)
        if not training:
            return self._evaluate(args, kwargs, labels)
        schedule = self._schedule(training, args, kwargs, labels)
        step_args, step_kwargs, target = (), {}, None
        if self.is_first:
            step_args, step_kwargs = args, kwargs
        if self.is_last:
            if self.user_loss_fn is None:  # the model's own loss: the last stage's forward gets the labels
                step_kwargs = {**step_kwargs, "labels": labels}
                target = torch.zeros(batch_size, device=self.device)
            else:
                target = labels
        losses: list[torch.Tensor] = []
        schedule.step(*step_args, target=target, losses=losses if self.is_last else None, return_outputs=False,
                      **step_kwargs)
        loss = torch.zeros((), device=self.device)
        if self.is_last:  # the schedule's losses are the backpropagated shares: their sum is the window's part
            loss = torch.stack([share.detach() for share in losses]).sum() * self.accumulation_steps
        dist.broadcast(loss, src=self.last_rank, group=self.group)
        self.last_loss = loss
        return loss

    def _evaluate(self, args: tuple[Any, ...], kwargs: dict[str, Any], labels: Any) -> torch.Tensor:
        """Forward only; the output (or ``loss_fn(output, labels)``) sent from the last stage to every stage."""
        with torch.no_grad():
            schedule = self._schedule(False, args, kwargs, labels)
            output = schedule.step(*args, **kwargs) if self.is_first else schedule.step()
            if self.is_last and labels is not None:
                extra = {} if self._num_items is None else {"num_items_in_batch": self._num_items}
                output = self.user_loss_fn(output, labels, **extra)  # type: ignore[misc]
        # The shape and dtype first (the other stages have not seen the output), or why it cannot be sent.
        meta: list[Any] = [None]
        if self.is_last:
            meta[0] = ((tuple(output.shape), output.dtype) if isinstance(output, torch.Tensor) else
                       f"the model's output is a {type(output).__name__}; evaluation under pp_size > 1 sends one tensor "
                       "from the last stage to every stage: return a tensor, or pass labels with prepare(..., loss_fn=...)")
        dist.broadcast_object_list(meta, src=self.last_rank, group=self.group)
        if isinstance(meta[0], str):
            raise ConfigurationError(meta[0])
        if not self.is_last:
            output = torch.empty(meta[0][0], dtype=meta[0][1], device=self.device)
        dist.broadcast(output, src=self.last_rank, group=self.group)
        return output  # type: ignore[no-any-return]

    def forward_only(self, args: tuple[Any, ...], kwargs: dict[str, Any], labels: Any) -> None:
        """Forward only, each micro-batch's labels to the last stage (a model computing its own loss in
        evaluation); the last stage's module keeps what the caller needs, nothing is sent here."""
        self._num_items = None
        self._check_call(True, args, kwargs, labels)  # the batch splits into micro-batches
        with torch.no_grad():
            schedule = self._schedule(False, args, kwargs, labels)
            last = {"labels": labels} if self.is_last else {}  # a V placement holds the first and the last stage
            if self.is_first:
                schedule.step(*args, **kwargs, **last)
            else:
                schedule.step(**last)

    def _check_call(self, training: bool, args: tuple[Any, ...], kwargs: dict[str, Any], labels: Any) -> int:
        """The batch size; refuses, on every process alike (they all hold the batch), a call the pipeline
        cannot run."""
        if not training and labels is not None and self.user_loss_fn is None:
            raise ConfigurationError("In evaluation under pp_size > 1, call the model without labels (its output comes "
                                     "back on every process), or give prepare(..., loss_fn=...) to get the loss.")
        if self._num_items is not None and not self._loss_takes_items:
            raise ConfigurationError(
                f"The model was called with num_items_in_batch, but loss_fn {getattr(self.user_loss_fn, '__name__', '')!r} "
                "takes no num_items_in_batch argument: give prepare(..., loss_fn=fn) with fn(output, labels, "
                "num_items_in_batch) returning the sum over the items divided by num_items_in_batch, or call the "
                "model without it for a mean loss.")
        if training and labels is None:
            raise ConfigurationError("Under pp_size > 1 call the prepared model with labels: model(inputs, "
                                     "labels=labels); the last stage computes the loss from them (with prepare(..., "
                                     "loss_fn=...), or the model's own loss when it takes labels).")
        batch_size = next((find_batch_size(value) for value in (*args, *kwargs.values())
                           if isinstance(value, torch.Tensor) and value.dim() > 0), None)
        if batch_size is None:
            raise ConfigurationError("Under pp_size > 1 the model's inputs must hold a tensor with a batch dimension.")
        check_divisible(batch_size, self.microbatches)
        return batch_size


class PipelineStrategy(Strategy):
    """One pipeline stage per process (``ParallelismConfig(pp_size=...)``).

    Args:
        device: this process's device.
        precision: the precision plugin (fp16's loss scaling is refused: backward runs inside the schedule).
        distributed_type: Accelerate's reporting value (``MULTI_GPU``/``MULTI_CPU``).
        num_processes: processes in the run (``pp_size x dp_replicate_size``).
        config: the run's ``ParallelismConfig`` with its mesh.
    """

    def __init__(self, device: torch.device, precision: Any, distributed_type: Any, num_processes: int = 1, *,
                 config: ParallelismConfig) -> None:
        super().__init__(device, precision, distributed_type, num_processes)
        config.validate(num_processes, device_type=device.type)
        if getattr(precision, "scaler", None) is not None:
            raise ConfigurationError("mixed_precision='fp16' under pp_size > 1: the loss scaler cannot scale a backward "
                                     "that runs inside the pipeline schedule; use bf16 or fp32.")
        self.config = config
        self._loss_fn: Callable[..., Any] | None = None
        self._runners: list[_PipelineRunner] = []
        self._layouts: dict[int, Any] = {}
        self._full_keys: set[str] = set()
        self._states = PipelineStates()  # the main process reads the other stages' state alone (Trainer's saves)

    def set_loss_fn(self, loss_fn: Callable[..., Any]) -> None:
        """The loss the last stage computes per micro-batch: ``loss_fn(output, labels)`` (a mean over its rows),
        or ``loss_fn(output, labels, num_items_in_batch=n)`` when the model is called with that count."""
        self._loss_fn = loss_fn

    def observe_prepare_call(self, objects: Sequence[Any], *, split_batches: bool = False) -> None:
        """Refuse, before anything is prepared, a data loader whose batches do not split into micro-batches."""
        for obj in objects:
            batch_size = getattr(obj, "batch_size", None) if isinstance(obj, torch.utils.data.DataLoader) else None
            if isinstance(batch_size, int):
                check_divisible(batch_size, self.config.pipeline_microbatches)

    def prepare(self, models: list[nn.Module], optimizers: list[torch.optim.Optimizer], *,
                device_placement: Sequence[bool], evaluation_mode: bool = False,
                accumulation_steps: int | None = None) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
        """Cut the one model into this process's stage, point its optimizers at the stage's parameters, and
        wrap it in :class:`PipelinedModel`."""
        if len(models) != 1 or evaluation_mode:
            raise ConfigurationError(f"pp_size > 1 prepares one model for training per run; got {len(models)} models"
                                     f"{' for evaluation' if evaluation_mode else ''} in this prepare call.")
        stages = int(self.config.pp_size)  # type: ignore[arg-type]
        transformers_model = pipeline_hf.transformers_pp_plan(models[0]) is not None
        if self.config.pp_split_points is None and not transformers_model:
            raise ConfigurationError(
                f"pp_size={stages} but {type(models[0]).__name__} has no split points: pass ParallelismConfig("
                f"pp_size={stages}, pp_split_points=[...]) with the "
                f"{stages * self.config.pipeline_stages_per_process - 1} module names where stages 1.. begin "
                "(names from model.named_modules()).")
        # What checkpoints need from before the cut: the full model's keys and each optimizer's names.
        self._full_keys = set(models[0].state_dict())
        for optimizer in optimizers:
            try:
                self._layouts[id(optimizer)] = optimizer_layout(models[0], optimizer)
            except CheckpointError as error:  # raised if it is ever saved: training needs no names
                self._layouts[id(optimizer)] = str(error)
        hf_stages: list[pipeline_hf.TransformersStage] | None = None
        if transformers_model:
            model, stage_modules, hf_stages, tied = self._cut_transformers(models[0])
        else:
            model, stage_modules = self._cut(models[0])
        if device_placement[0]:
            model = model.to(self.device)  # in place: the stages' views share its modules
        self.apply_precision(model)
        kept = {id(p) for p in model.parameters()}
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["params"] = [p for p in group["params"] if id(p) in kept]
        if hf_stages is not None and tied and shards_stages(self.config):
            # The tie is kept by summing two stages' full gradients after the schedule; FSDP2/TP have
            # reduce-scattered them into shards by then, which that sum does not handle yet.
            raise ConfigurationError(
                f"{type(models[0]).__name__} ties its input and output embeddings across pipeline stages, which "
                f"pp_size={stages} with dp_shard_size/tp_size does not support yet: build the model with "
                "tie_word_embeddings=False, or use dp_replicate_size for the data-parallel dimension.")
        if shards_stages(self.config):  # PP x FSDP2: the stage sharded over its dp_shard sub-mesh, in place
            model = shard_stage(model, self.config, self.device_mesh, optimizers)
        runner = _PipelineRunner(model, stage_modules, self.config, self.device_mesh, self.device, self._loss_fn,
                                 accumulation_steps or 1)
        self._runners.append(runner)
        if not shards_stages(self.config):  # sharded stages: a shard's full tensors need every process
            self._states.start(self.device_mesh, model, optimizers, self._layouts)
        if hf_stages is not None:
            call = pipeline_hf.TransformersPipelineCall(model, hf_stages, runner, self._pp_group(), tied)
            return [PipelinedModel(model, runner, call)], optimizers
        return [PipelinedModel(model, runner)], optimizers

    def _cut_transformers(self, model: nn.Module) -> tuple[nn.Module, dict[int, nn.Module], Any, Any]:
        """Cut a transformers model by its plan into this process's stages (several under the interleaved,
        looped and V schedules)."""
        processes, rank = int(self.config.pp_size), int(self.device_mesh.get_local_rank("pp"))  # type: ignore[arg-type]
        schedule = str(self.config.pp_schedule)
        points = None if self.config.pp_split_points is None else list(self.config.pp_split_points)
        # Without split points: an even split into the schedule's stages (two per process where it places several).
        num_stages = processes * self.config.pipeline_stages_per_process if points is None else len(points) + 1
        check_schedule(schedule, processes, num_stages, self.config.pipeline_microbatches)
        check_sharded_schedule(schedule, self.config)
        kept = local_stages(schedule, processes, num_stages, rank)
        cut, stage_modules, tied = pipeline_hf.cut_transformers_stages(model, points, kept, num_stages,
                                                                      self._states.full_weights)
        return cut, dict(stage_modules), list(stage_modules.values()), tied

    def _cut(self, model: nn.Module) -> tuple[nn.Module, dict[int, nn.Module]]:
        """Check the schedule can run, then cut ``model`` (in place) into this process's stages.

        Returns:
            the process's model (its stages' modules, full-model names) and each of its stages' module.
        """
        processes, rank = int(self.config.pp_size), int(self.device_mesh.get_local_rank("pp"))  # type: ignore[arg-type]
        points, schedule = list(self.config.pp_split_points or ()), str(self.config.pp_schedule)
        num_stages = len(points) + 1
        check_schedule(schedule, processes, num_stages, self.config.pipeline_microbatches)
        if schedule not in PP_MULTI_STAGE:
            return cut_stage(model, points, rank, processes), {rank: model}
        check_sharded_schedule(schedule, self.config)
        stage_modules = cut_stages(model, points, local_stages(schedule, processes, num_stages, rank), num_stages)
        return model, stage_modules

    def compile(self, model: nn.Module, backend: str, options: dict[str, Any]) -> nn.Module:
        """Refused: the prepared model's call runs a whole pipeline schedule (communication and backward),
        which ``torch.compile`` cannot capture, and compiling the stage alone is not done yet."""
        raise ConfigurationError(f"dynamo_backend={backend!r} under pp_size > 1 is not available yet: the pipelined call "
                                 "runs the schedule's communication and backward. Use dynamo_backend='no'.")

    @property
    def device_mesh(self) -> Any:
        """The run's mesh (its ``pp`` dimension holds the stages)."""
        return self.config.device_mesh

    def is_wrapped(self, model: nn.Module) -> bool:
        return isinstance(model, PipelinedModel)

    def unwrap(self, model: nn.Module) -> nn.Module:
        model = unwrap_common(model)
        return model.module if isinstance(model, PipelinedModel) else model

    # ------------------------------------------------------------------------------------ the step
    def backward(self, loss: torch.Tensor, *, sync: bool = True, accumulation_steps: int = 1, **kwargs: Any) -> None:
        """Nothing to do: the pipelined call already ran the backward. Refuses a loss from elsewhere.

        With ``dp_replicate_size > 1`` (PP x DDP), a synchronising micro-step averages the stage's
        gradients over its replicas here, where DDP would.

        Raises:
            ConfigurationError: ``loss`` is not what the prepared model's last call returned, or the
                accumulation steps changed since ``prepare``.
        """
        runner = next((r for r in self._runners if r.last_loss is loss or any(owns(loss) for owns in r.loss_owners)),
                      None)  # a list of one runner
        if runner is None:
            raise ConfigurationError(
                "Under pp_size > 1 the backward runs inside the prepared model's call; accelerator.backward takes "
                "exactly the loss that call returned (loss = model(inputs, labels=labels)). A loss computed outside "
                "the pipeline has no gradient path through the stages.")
        if accumulation_steps != runner.accumulation_steps:
            raise ConfigurationError(f"gradient_accumulation_steps changed from {runner.accumulation_steps} (at prepare) "
                                     f"to {accumulation_steps}: under pp_size > 1 set it before prepare.")
        for hook in runner.backward_hooks:
            hook(loss)
        if sync and self.config.dp_replicate_enabled and not shards_stages(self.config):  # else FSDP2 reduced
            self._average_over_replicas(runner.module)

    def _average_over_replicas(self, module: nn.Module) -> None:
        """PP x DDP: average this stage's gradients over its replicas (``dp_replicate``), in one all-reduce."""
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        dist.all_reduce(flat, group=self.device_mesh["dp_replicate"].get_group())
        flat /= int(self.config.dp_replicate_size)  # type: ignore[arg-type]
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the total norm over every stage's gradients (this stage's norm reduced over ``pp``)."""
        params = [p for p in parameters if p.grad is not None]
        grads = [p.grad for p in params if p.grad is not None]
        counted = [p.grad for p in params  # a weight tied across stages counts once
                   if p.grad is not None and not getattr(p, pipeline_hf.PP_TIED_MIRROR, False)]
        norm_type = float(norm_type)
        local = (full_value(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, norm_type) for g in counted]),
                                                     norm_type))  # sharded gradients: the norm over their shards
                 if counted else torch.zeros((), device=self.device))
        group = self.device_mesh["pp"].get_group()
        if norm_type == float("inf"):
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
            total = local
        else:
            powered = local.pow(norm_type)
            dist.all_reduce(powered, op=dist.ReduceOp.SUM, group=group)
            total = powered.pow(1.0 / norm_type)
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grad in grads:
            local_part(grad).mul_(coefficient.to(grad.device))
        return total

    # ---------------------------------------------------------------------------------- checkpoints
    # One checkpoint in the single-process format, under the full model's names
    # (:mod:`hasten.strategies.pipeline_checkpoint`): it loads on any pp_size, DDP or one process.
    def _pp_group(self) -> Any:
        return self.device_mesh["pp"].get_group()

    def _layout(self, optimizer: torch.optim.Optimizer) -> Any:
        return checked_layout(self._layouts.get(id(optimizer)))

    def optimizer_state_to_load(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A full-model optimizer state (one process's, as transformers' Trainer resumes it) re-indexed onto
        this stage: :func:`~hasten.strategies.pipeline_checkpoint.optimizer_state_for_stage`."""
        return optimizer_state_for_stage(state_dict, self._runners[-1].module, optimizer,
                                         self._layouts.get(id(optimizer)), sharded=shards_stages(self.config))

    def optimizer_state_to_save(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The full model's optimizer state on the main process (unsharded stages), as one process's
        ``optimizer.state_dict()`` (transformers' Trainer saves it from there alone); elsewhere the stage's."""
        return self._states.optimizer_state(optimizer)

    def model_state_dict(self, model: nn.Module, *, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The full model's state dict, gathered from every stage, on every process (all must call it)."""
        return full_weights(self.unwrap(model), self._pp_group())

    def weights_for_save(self, models: list[nn.Module]) -> list[dict[str, torch.Tensor]]:
        if shards_stages(self.config):
            return []  # sharded stages write their own shards (nothing gathered)
        return [self.model_state_dict(model) for model in models]

    def save(self, models: list[nn.Module], optimizers: list[torch.optim.Optimizer], folder: Path, *,
             weights: list[dict[str, torch.Tensor]], writer: bool, safe_serialization: bool = True,
             sink: Sink, engine_kwargs: Mapping[str, Any] | None = None) -> None:
        """The writer stores the full weights and the optimizers in the single-process format (no engine
        options: :meth:`engine_checkpoint_kwargs` refused any before the save started); sharded stages
        (PP x FSDP2) write one DCP checkpoint instead, every process its shards."""
        stage = self.unwrap(models[0])
        if shards_stages(self.config):
            save_sharded(stage, optimizers, [self._layout(opt) for opt in optimizers], folder, sink)
            return
        states = [full_optimizer_state(stage, opt, self._layout(opt), self._pp_group()) for opt in optimizers]
        if writer:
            write_single_process_files(folder, weights, states, safe_serialization, sink)

    def check(self, models: list[nn.Module], optimizers: list[torch.optim.Optimizer], folder: Path, *,
              strict: bool = True, map_location: Any = "cpu") -> CheckedState:
        """Read the full checkpoint; keep this stage's weights and its optimizer state, re-indexed. A DCP
        checkpoint (saved by sharded stages, or by FSDP2 without pipeline) is checked here, read in :meth:`load`."""
        stage = self.unwrap(models[0])
        if sharded.model_dir(folder, 0).is_dir():
            check_sharded(stage, optimizers, [self._layout(opt) for opt in optimizers], self._full_keys, folder,
                          strict=strict)
            return CheckedState(models=_DCP)
        path, saved = ckpt.read_model_weights(folder, 0)
        unknown = sorted(set(saved) - self._full_keys)
        if strict and unknown:
            raise CheckpointError(f"{path} holds keys the model does not have: {unknown[:8]}. Nothing was loaded.")
        mine = {key: value for key, value in saved.items() if key in stage.state_dict()}
        if shards_stages(self.config):  # DTensor parameters: names and global shapes
            check_shapes(stage, mine, path)
        else:
            ckpt.check_model_weights(stage, mine, path, strict=strict)
        optimizer_states = []
        for i, optimizer in enumerate(optimizers):
            file = folder / ckpt.OPTIMIZER.format(suffix=ckpt.suffix(i))
            state = stage_optimizer_state(ckpt.torch_load(file, map_location), stage, optimizer, self._layout(optimizer))
            checks.check_optimizer_state(optimizer, state, file)
            optimizer_states.append(state)
        if shards_stages(self.config):  # full tensors into sharded parameters: load() places them
            return CheckedState(models=(mine, optimizer_states))
        return CheckedState(optimizer_states=optimizer_states, models=[mine])

    def load(self, models: list[nn.Module], optimizers: list[torch.optim.Optimizer], folder: Path,
             checked: CheckedState, *, strict: bool = True, engine_kwargs: Mapping[str, Any] | None = None) -> None:
        """Load what :meth:`check` accepted: DCP shards, full tensors into a sharded stage, or (base) the weights."""
        stage = self.unwrap(models[0])
        if checked.models is _DCP:
            load_sharded(stage, optimizers, [self._layout(opt) for opt in optimizers], folder)
        elif isinstance(checked.models, tuple):
            load_full_into_sharded(stage, checked.models[0], optimizers, checked.models[1])
        else:
            super().load(models, optimizers, folder, checked, strict=strict, engine_kwargs=engine_kwargs)

    def accumulated_gradients(self, model: nn.Module) -> dict[str, torch.Tensor]:
        raise CheckpointError("save_state inside an accumulation window is not available under pp_size > 1 yet: "
                              "save after the optimizer step (when accelerator.sync_gradients is True).")


__all__ = ["PipelineStrategy", "PipelinedModel"]
