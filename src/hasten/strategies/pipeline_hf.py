"""Pipeline stages of a transformers model, cut by its ``base_model_pp_plan``, in the ordinary loop.

A transformers model names its pipeline units in its plan (``model.pp_plan``: the base model's
``base_model_pp_plan`` under its prefix plus the head's ``_pp_plan``; for ``LlamaForCausalLM``:
``model.embed_tokens``, ``model.layers``, ``model.norm``, ``lm_head``). The decoder layers (the plan's
``nn.ModuleList``) are dealt out evenly over the stages, modules before the first layer go to the
first stage and modules after the last layer to the last; :func:`transformers_split_points` can make
the first or last stage lighter. Modules the plan does not list (rotary embeddings) hold no weights
and stay on every stage. As with any model, nothing is renumbered: a stage's state-dict keys are the
full model's.

Each stage runs the model's own forward (:class:`TransformersStage`): the first stage the base model
from ``input_ids``, the next ones the base model from the received hidden states as ``inputs_embeds``
(the skipped modules hand them through), the last one the whole model with ``labels``, so the loss
is the model's ``loss_function``. ``attention_mask`` and ``position_ids`` travel with the hidden states
(and ``input_ids`` for heads other than a causal LM's: a classifier pools at the last real token).
The cut model's own ``forward`` is routed into the pipeline too (Trainer evaluates the unwrapped model).
In evaluation with labels the last stage runs the model's forward with them, as in training, and its
outputs (loss, logits, a fused head's per-token ones) are sent to every stage. A PEFT wrapper is cut by
its transformers model's plan under the wrapper's names (the adapters live inside the model's modules).
Under the schedules with several stages per process, each of the process's stages runs this on a view
of the cut model that holds only that stage's units (:func:`cut_transformers_stages`).

The loss is token-normalised over the whole batch, as one process computes it: the last stage divides
each micro-batch's token sum by ``num_items_in_batch`` when the caller passes it (Trainer does) and by
the batch's label count otherwise (causal LM losses), so padding spread unevenly over micro-batches
changes nothing. The prepared model returns the model's output type with ``.loss`` on every process.

Tied weights across stages (``tie_word_embeddings=True``: the embedding on the first stage, the head
on the last) stay tied: both stages hold the weight, and ``accelerator.backward`` sums the two
stages' gradient contributions over the pipeline group (one all-reduce of the weight's gradient per
backward), so both copies see the same gradient and the same optimizer step; ``clip_grad_norm_``
counts the weight once.

A caller may scale the returned loss in place before ``accelerator.backward`` (Trainer multiplies it
by the process count when it averages tokens across devices): the gradients are scaled to match, as
a backward of the scaled loss would give. The factor must stay the same within a gradient window.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hasten.exceptions import ConfigurationError
from hasten.strategies.pipeline_hf_saving import guard_save_pretrained, save_adapters_of_every_stage, to_meta
from hasten.strategies.pipeline_schedules import stage_views
from hasten.strategies.pipeline_split import skip_other_stages

#: Set on the second and later stages' copies of a weight tied across stages: ``clip_grad_norm_`` counts it once.
PP_TIED_MIRROR = "_hasten_pp_tied_mirror"
#: Batch tensors every stage needs (the attention of each layer), handed along with the hidden states.
_CARRIED = ("attention_mask", "position_ids")
#: Arguments the stages set themselves.
_DROPPED = ("use_cache", "return_dict", "cache", "past_key_values")


def wrapped_transformers_model(model: nn.Module) -> tuple[nn.Module, str]:
    """The transformers model inside a PEFT wrapper and its module name there; ``(model, "")`` for any other model.

    PEFT's adapters (LoRA and the like) live inside the transformers model's own modules, so the wrapper is
    cut by the inner model's plan under the wrapper's names (``base_model.model.`` + the plan's names).

    Raises:
        ConfigurationError: a prompt-learning method (prompt, prefix or P-tuning): its forward adds virtual
            tokens outside the transformers model, which no stage could do for the others.
    """
    config = getattr(model, "active_peft_config", None) if hasattr(model, "peft_config") else None
    get_base_model = getattr(model, "get_base_model", None)
    if config is None or not callable(get_base_model):
        return model, ""
    if getattr(config, "is_prompt_learning", False):
        raise ConfigurationError(
            f"PEFT's {getattr(config, 'peft_type', 'prompt-learning')} adds virtual tokens in the wrapper's forward, "
            "outside the transformers model's modules, which pipeline stages cannot split: under pp_size > 1 use an "
            "adapter that lives inside the model's modules (LoRA, IA3, ...), or pp_size=1.")
    inner = get_base_model()
    name = next((name for name, module in model.named_modules() if module is inner and name), None)
    return (inner, name) if name is not None else (model, "")


def transformers_pp_plan(model: nn.Module) -> list[str] | None:
    """The module names of ``model``'s pipeline plan in model order, or ``None`` for a model without one.

    A head's modules registered after the base model and holding weights (a classifier's ``score``)
    belong to the plan when the head's own ``_pp_plan`` does not name them: the last stage, which runs
    the head's forward, holds them. A PEFT wrapper's plan is its transformers model's, under the
    wrapper's names.
    """
    inner, prefix = wrapped_transformers_model(model)
    plan = getattr(inner, "pp_plan", None)
    if not plan:  # transformers before the plans moved onto the model: the config's plan under the prefix
        config_plan = getattr(getattr(inner, "config", None), "base_model_pp_plan", None) or {}
        base_prefix = getattr(inner, "base_model_prefix", "")
        base = getattr(inner, base_prefix, None) if base_prefix else None
        plan = {**(getattr(type(inner), "_pp_plan", None) or {}),
                **{(f"{base_prefix}.{k}" if isinstance(base, nn.Module) else k): v for k, v in config_plan.items()}}
    if not plan or not hasattr(inner, "base_model"):
        return None
    children = [name for name, _ in inner.named_children()]
    base_prefix = getattr(inner, "base_model_prefix", "")
    heads = children[children.index(base_prefix) + 1:] if base_prefix in children else []
    plan = [*plan, *(name for name in heads if name not in plan and any(True for _ in inner.get_submodule(name).parameters()))]
    names = [f"{prefix}.{name}" if prefix else name for name in plan]
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    missing = [name for name in names if name not in order]
    if missing:
        raise ConfigurationError(
            f"{type(model).__name__}'s pipeline plan names {missing}, which are not its own modules: a wrapped "
            "transformers model (other than PEFT's) is not split under pp_size > 1; prepare the transformers model "
            "itself.")
    return sorted(names, key=order.__getitem__)


def _plan_units(model: nn.Module, plan: list[str]) -> tuple[list[tuple[str, bool]], list[str]]:
    """The plan's units in model order as ``(name, is_layer)`` (a ``ModuleList`` gives one unit per layer),
    and the modules outside the plan, kept on every stage.

    Raises:
        ConfigurationError: a module outside the plan holds weights (every stage would train a copy).
    """
    ancestors = {".".join(name.split(".")[:i]) for name in plan for i in range(len(name.split(".")))}
    units: list[tuple[str, bool]] = []
    shared: list[str] = []
    weighted: list[str] = []

    def walk(module: nn.Module, prefix: str) -> None:
        weighted.extend(f"{prefix}{key}" for key, _ in module.named_parameters(recurse=False))
        for child_name, child in module.named_children():
            name = f"{prefix}{child_name}"
            if name in plan:
                if isinstance(child, nn.ModuleList):
                    units.extend((f"{name}.{i}", True) for i in range(len(child)))
                else:
                    units.append((name, False))
            elif name in ancestors:
                walk(child, f"{name}.")
            else:
                shared.append(name)
                weighted.extend(f"{name}.{key}" for key, _ in child.named_parameters())

    walk(model, "")
    if weighted:
        raise ConfigurationError(
            f"{type(model).__name__} has weights outside its pipeline plan ({weighted[:4]}): they would be trained "
            "on every stage. Name their module in the plan (model.pp_plan = {**model.pp_plan, 'NAME': (inputs, "
            "outputs)}; it goes to the stage of the units beside it) or keep those weights inside a planned module.")
    if not any(is_layer for _, is_layer in units):
        raise ConfigurationError(f"{type(model).__name__}'s pipeline plan {plan} has no list of layers to deal out "
                                 "over the stages.")
    return units, shared


def transformers_split_points(model: nn.Module, num_stages: int, *, first_stage_less_layers: int = 0,
                              last_stage_less_layers: int = 0) -> list[str]:
    """Where stages ``1..num_stages-1`` begin for a transformers model: its layers dealt out evenly.

    The first (last) stage holds ``first_stage_less_layers`` (``last_stage_less_layers``) layers fewer
    than an even share, to make room for the embedding (the head and its loss). Pass the result as
    ``ParallelismConfig(pp_split_points=...)`` (or ``parallelism_config_pp_split_points`` in the launch
    config, comma-separated); without split points a transformers model is split evenly.

    Example:
        >>> transformers_split_points(llama_with_8_layers, 4, first_stage_less_layers=1, last_stage_less_layers=1)
        ['model.layers.1', 'model.layers.3', 'model.layers.6']

    Raises:
        ConfigurationError: the model has no pipeline plan, or a stage would get fewer than no layers.
    """
    plan = transformers_pp_plan(model)
    if plan is None:
        raise ConfigurationError(f"{type(model).__name__} has no pipeline plan (base_model_pp_plan).")
    layers = [name for name, is_layer in _plan_units(model, plan)[0] if is_layer]
    total = len(layers) + first_stage_less_layers + last_stage_less_layers
    share, extra = divmod(total, num_stages)
    sizes = [share + (1 if i >= num_stages - extra else 0) for i in range(num_stages)]  # the extras at the end
    sizes[0] -= first_stage_less_layers
    sizes[-1] -= last_stage_less_layers
    if min(sizes) < 0 or num_stages < 2:
        raise ConfigurationError(
            f"{len(layers)} layers over {num_stages} stages with first_stage_less_layers={first_stage_less_layers} "
            f"and last_stage_less_layers={last_stage_less_layers} leaves a stage fewer than no layers: ask for fewer.")
    starts = [sum(sizes[:i]) for i in range(1, num_stages)]
    if any(start >= len(layers) for start in starts):
        raise ConfigurationError(f"{len(layers)} layers cannot start {num_stages} stages: use pp_size <= {len(layers)}.")
    return [layers[start] for start in starts]


def transformers_stage_units(model: nn.Module, split_points: list[str] | None,
                             num_stages: int) -> list[tuple[str, int]]:
    """Each unit of the plan with its stage; split points (plan units, in order) or the even split."""
    plan = transformers_pp_plan(model)
    assert plan is not None
    units, _ = _plan_units(model, plan)
    points = split_points if split_points is not None else transformers_split_points(model, num_stages)
    names = [name for name, _ in units]
    prefix = wrapped_transformers_model(model)[1]
    if prefix:  # a PEFT wrapper: the transformers model's names (``model.layers.2``) name its units too
        points = [point if point in names else f"{prefix}.{point}" for point in points]
    if len(points) != num_stages - 1 or any(point not in names for point in points):
        raise ConfigurationError(
            f"pp_size={num_stages} with {type(model).__name__} needs {num_stages - 1} split points among its pipeline "
            f"units ({names[:3]} ... {names[-2:]}), got {points!r}; or leave pp_split_points unset for an even split.")
    starts = [names.index(point) for point in points]
    if starts != sorted(set(starts)) or starts[0] == 0:
        raise ConfigurationError(f"pp split points {points!r} must follow the model's order and leave the first "
                                 "stage a module.")
    return [(name, sum(1 for start in starts if i >= start)) for i, name in enumerate(names)]


def _tied_weights(model: nn.Module, units: list[tuple[str, int]]) -> list[tuple[nn.Parameter, list[int]]]:
    """Weights held by units of different stages, each with the stages that hold it (in model order)."""
    holders: dict[int, tuple[nn.Parameter, list[int]]] = {}
    for name, stage in units:
        for param in model.get_submodule(name).parameters():
            entry = holders.setdefault(id(param), (param, []))
            if stage not in entry[1]:
                entry[1].append(stage)
    return [entry for entry in holders.values() if len(entry[1]) > 1]


class TransformersStage(nn.Module):
    """What this process's pipeline stage runs: the transformers model's own forward on its part.

    Per call the prepared model sets ``carried`` (the batch tensors handed along), ``constants`` (the
    call's other arguments), ``loss_divisor`` and ``loss_multiplier``; with labels the last stage keeps
    each micro-batch's other outputs in ``extras`` (a fused head's ``log_probs``...; in evaluation the
    loss and the logits too).

    Args:
        model: the cut model (the other stages' units skipped), under its full-model names; a PEFT
            wrapper's forward runs as the model's (its adapters sit inside the transformers model).
        stage_index: this stage.
        num_stages: stages in the pipeline.
    """

    def __init__(self, model: nn.Module, stage_index: int, num_stages: int) -> None:
        super().__init__()
        self.model = model
        inner = wrapped_transformers_model(model)[0]
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.carried: tuple[str, ...] = ()
        self.constants: dict[str, Any] = {}
        self.loss_divisor: Any = None
        self.loss_multiplier = 1.0
        #: The model computes the loss from ``labels`` (else the last stage returns logits for ``loss_fn``).
        self.own_loss = True
        self.extras: list[dict[str, torch.Tensor]] = []
        self.output_type: type | None = None
        self.base_model: nn.Module = inner.base_model  # type: ignore[assignment]
        #: The model's forward as it was before the cut (a trainer may have patched it, as TRL's fused head does).
        self.model_forward: Any = model.forward
        base_parameters = inspect.signature(self.base_model.forward).parameters
        self._base_arguments = {name for name, p in base_parameters.items() if p.kind != p.VAR_KEYWORD}
        if not self.is_first:  # input_ids handed along for a head (a classifier pools at the last token)
            self.base_model.register_forward_pre_hook(_embeds_over_ids, with_kwargs=True)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """First stages: ``(hidden states, *carried)``; the last: the micro-batch's loss share (or logits)."""
        labels = kwargs.pop("labels", None)
        if self.is_first:
            inputs = dict(kwargs)
        else:
            hidden, *carried = args
            inputs = {"inputs_embeds": hidden, **dict(zip(self.carried, carried))}
        if not self.is_last:  # the base model takes only its own arguments (not a head's, such as fused_lm_head)
            inputs.update({k: v for k, v in self.constants.items() if k in self._base_arguments}, use_cache=False)
            hidden = self.base_model(**inputs).last_hidden_state
            return (hidden, *(inputs[name] for name in self.carried))
        inputs.update(self.constants, use_cache=False)
        if labels is None or not self.own_loss:
            return self.model_forward(**inputs).logits
        if self.loss_divisor is not None:
            inputs["num_items_in_batch"] = self.loss_divisor
        output = self.model_forward(**inputs, labels=labels)
        self.output_type = type(output)
        training = torch.is_grad_enabled()  # kept for the caller (the last micro-batches' are sent)
        self.extras.append({key: value.detach().reshape(1) if key == "loss" else value.detach()
                            for key, value in output.items() if isinstance(value, torch.Tensor)
                            and not (training and key in ("loss", "logits"))})
        # Evaluation: the schedule only merges these; the caller adds up the losses kept above
        return output.loss * self.loss_multiplier if training else output.loss.detach().reshape(1)


def _embeds_over_ids(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The base model of a later stage runs from the received hidden states, not the handed-along ``input_ids``
    (a transformers model takes one of the two; its head still reads the ids, to pool at the last token)."""
    if kwargs.get("inputs_embeds") is None:
        return None
    if args:  # the ids given by position (a classifier's forward calls its base model so)
        return (None, *args[1:]), kwargs
    return args, {**kwargs, "input_ids": None}


def _output_class(model: nn.Module) -> Any:
    """The model's output type (``CausalLMOutputWithPast``...), else transformers' ``ModelOutput``."""
    from transformers.utils import ModelOutput

    returned = inspect.signature(type(model).forward).return_annotation
    if isinstance(returned, str):  # postponed annotations: look the name up in the model's module
        returned = getattr(inspect.getmodule(type(model)), returned.split("|")[0].strip(), None)
    return returned if isinstance(returned, type) and issubclass(returned, ModelOutput) else ModelOutput


class _GradProbe(torch.autograd.Function):
    """Identity that records the gradient reaching it: how the caller's loss depends on an output."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str, sink: dict[str, torch.Tensor]) -> torch.Tensor:
        ctx.hasten_sink, ctx.name = sink, name
        return tensor.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        ctx.hasten_sink[ctx.name] = grad
        return None, None, None


def _probed(value: torch.Tensor, name: str, sink: dict[str, torch.Tensor]) -> torch.Tensor:
    return _GradProbe.apply(value.detach().requires_grad_(), name, sink)  # type: ignore[no-any-return]


class TransformersPipelineCall:
    """The prepared transformers model's call: batch bookkeeping around the pipeline runner.

    Sets the stage's per-call fields and returns the model's output type on every process: ``.loss``
    (and a fused head's per-token outputs) in training, ``.logits`` in evaluation without labels. The
    returned loss and ``log_probs`` are probes: in ``accelerator.backward(loss)`` a short backward of
    the caller's loss through them gives the factor between it and the loss the pipeline already
    backpropagated (Trainer's ``loss *= num_processes``, a ``/ accumulation`` or TRL's ``-log_probs.sum() /
    num_items``), and the gradients are scaled to match; then tied weights' gradients are summed.
    """

    def __init__(self, model: nn.Module, stages: list[TransformersStage], runner: Any, group: Any,
                 tied: list[tuple[nn.Parameter | None, torch.Size, torch.dtype]]) -> None:
        # The transformers model (its loss_function and config are read), inside a PEFT wrapper or not
        self.model: Any = wrapped_transformers_model(model)[0]
        self.runner, self.group, self.tied = runner, group, tied
        #: This process's stages (several under the interleaved, looped and V schedules); ``stage``, the one
        #: whose per-call fields are set (then copied to the others): the last stage where this process has it.
        self.stages = stages
        self.stage = next((stage for stage in stages if stage.is_last), stages[0])
        self.last_rank = runner.last_rank
        self.output_class = _output_class(self.model)
        self.causal_lm = getattr(self.model, "loss_type", None) == "ForCausalLM"
        self.scale = 1.0
        self._fresh = True
        self._sink: dict[str, torch.Tensor] = {}
        self._label_mask: torch.Tensor | None = None
        self._snapshots: list[torch.Tensor | None] = []
        self._meta: dict[tuple[Any, ...], Any] = {}
        runner.loss_owners.append(self.owns)
        runner.backward_hooks.append(self.after_backward)

        def pipelined_forward(*args: Any, **kwargs: Any) -> Any:
            return self(model, args, kwargs)

        # The unwrapped model (what Trainer evaluates with) runs the pipeline too: its own forward would run
        # one stage of the model, the others' modules handing their input through.
        model.forward = pipelined_forward  # type: ignore[method-assign]

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        num_items = kwargs.pop("num_items_in_batch", None)
        for name in _DROPPED:
            kwargs.pop(name, None)
        labels = kwargs.get("labels")
        stage = self.stage
        carried = _CARRIED if self.causal_lm else (*_CARRIED, "input_ids")  # other heads may read the ids
        stage.carried = tuple(name for name in carried if isinstance(kwargs.get(name), torch.Tensor))
        stage.constants = {key: kwargs.pop(key) for key in list(kwargs)
                           if key != "labels" and not isinstance(kwargs[key], torch.Tensor)}
        stage.own_loss = self.runner.user_loss_fn is None
        # A causal LM's loss divides its token sum by num_items_in_batch; other heads' losses are means (transformers'
        # classifiers ignore the count), so the batch's loss is the mean of the equal micro-batches' own
        stage.loss_divisor = num_items if self.causal_lm else None
        if num_items is None and self.causal_lm and isinstance(labels, torch.Tensor):
            stage.loss_divisor = (labels[..., 1:] != -100).sum()  # the batch's tokens, as one process counts them
        # The runner divides each micro-batch's loss by the micro-batches: a share of the batch's sum is not.
        multiplier = self.runner.microbatches if stage.loss_divisor is not None else 1
        stage.loss_multiplier = multiplier * self.scale
        stage.extras = []
        self._share_fields()
        if not (torch.is_grad_enabled() and module.training):
            return self._evaluate(module, args, kwargs, labels)
        self._fresh = all(p.grad is None for p in self.model.parameters())
        self._snapshots = [None if p is None or p.grad is None else p.grad.detach().clone() for p, _, _ in self.tied]
        result = self.runner.step(module, args, kwargs)
        output_class, extras = self._extras(labels, stage.constants, training=True)
        self._sink = {}
        self._label_mask = extras.get("label_mask")
        fields = {key: _probed(value, key, self._sink) if key == "log_probs" else value for key, value in extras.items()}
        return output_class(loss=_probed(result / self.scale, "loss", self._sink), **fields)

    def _share_fields(self) -> None:
        """Give this process's other stages the call's fields (each stage's forward reads its own)."""
        for other in self.stages:
            if other is not self.stage:
                other.carried, other.constants, other.own_loss = self.stage.carried, self.stage.constants, self.stage.own_loss
                other.loss_divisor, other.loss_multiplier = self.stage.loss_divisor, self.stage.loss_multiplier
                other.extras = []

    def _evaluate(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], labels: Any) -> Any:
        """Forward only: the logits on every process; with labels, the model's own output with them.

        With labels the last stage runs the model's forward with each micro-batch's labels, as in
        training, and sends its outputs (the logits, a fused head's per-token ones) to every stage. The
        micro-batches' losses add up to the batch's when each is divided by the batch's count (a causal
        LM's tokens, or the caller's ``num_items_in_batch``); otherwise each is its micro-batch's mean, and
        their mean is the batch's (the micro-batches are equal).
        """
        if labels is None or not self.stage.own_loss:
            result = self.runner.step(module, args, kwargs)  # refuses labels without a loss it can compute
            return self.output_class(logits=result) if labels is None else self.output_class(loss=result)
        del kwargs["labels"]
        self.stage.extras = []
        self.runner.forward_only(args, kwargs, labels)
        output_class, extras = self._extras(labels, self.stage.constants, training=False)
        losses = extras.pop("loss")
        loss = losses.sum() if self.stage.loss_divisor is not None else losses.mean()
        return output_class(loss=loss, **extras)

    def _extras(self, labels: Any, constants: dict[str, Any], *, training: bool) -> tuple[Any, dict[str, torch.Tensor]]:
        """The last stage's output type and its outputs kept per micro-batch (whole batch), sent to every stage."""
        # The last micro-batches' (torch's shape inference of a new schedule runs the stage once before them).
        chunks = self.stage.extras[-self.runner.microbatches:]
        mine = {key: torch.cat([chunk[key] for chunk in chunks]) for key in (chunks[0] if chunks else ())}
        key = (training, tuple(labels.shape) if isinstance(labels, torch.Tensor) else None,
               tuple(sorted((name, repr(value)) for name, value in constants.items())))
        if key not in self._meta:  # once per batch shape: the type, names, shapes and dtypes
            meta: list[Any] = [None]
            if self.stage.is_last:
                meta[0] = (self.stage.output_type or self.output_class, {k: (v.shape, v.dtype) for k, v in mine.items()})
            dist.broadcast_object_list(meta, src=self.last_rank, group=self.group)
            self._meta[key] = meta[0]
        output_class, shapes = self._meta[key]
        extras = {}
        for name, (shape, dtype) in shapes.items():
            tensor = mine[name] if self.stage.is_last else torch.empty(shape, dtype=dtype, device=self.runner.device)
            dist.broadcast(tensor, src=self.last_rank, group=self.group)
            extras[name] = tensor
        return output_class, extras

    def owns(self, loss: torch.Tensor) -> bool:
        """Whether ``loss`` was computed from this call's returned outputs (its graph reaches a probe)."""
        seen, todo = 0, [loss.grad_fn]
        while todo and seen < 256:
            node = todo.pop()
            seen += 1
            if node is None:
                continue
            if getattr(node, "hasten_sink", None) is self._sink:
                return True
            todo.extend(next_node for next_node, _ in node.next_functions)
        return False

    def after_backward(self, loss: torch.Tensor) -> None:
        """In ``accelerator.backward``: match the caller's loss, then sum tied weights' gradients."""
        torch.autograd.backward(loss)
        self._rescale(self._factor())
        for (param, shape, dtype), snapshot in zip(self.tied, self._snapshots):
            if param is None or param.grad is None:
                part = torch.zeros(shape, dtype=dtype, device=self.runner.device)
            else:
                part = param.grad.detach() - snapshot if snapshot is not None else param.grad.detach().clone()
            dist.all_reduce(part, group=self.group)
            if param is not None:
                param.grad = part if snapshot is None else snapshot + part

    def _factor(self) -> float:
        """The caller's loss over the returned one, from the gradients that reached the probes.

        Raises:
            ConfigurationError: the loss weights the tokens' ``log_probs`` unequally (the pipeline
                backpropagated their plain mean).
        """
        factor = float(self._sink["loss"]) if "loss" in self._sink else 0.0
        grad = self._sink.get("log_probs")
        if grad is not None:
            valid = self._label_mask if self._label_mask is not None else torch.ones_like(grad, dtype=torch.bool)
            weights = grad[valid] * -self.stage.loss_divisor
            if weights.numel():
                mean = weights.mean()
                if not torch.allclose(weights, mean.expand_as(weights), rtol=1e-5, atol=1e-7 * float(mean.abs())):
                    raise ConfigurationError(
                        "Under pp_size > 1 the loss from the outputs' log_probs must be a constant times their sum over "
                        "the labelled tokens (the backward ran inside the model call with that loss); this loss weights "
                        "tokens unequally. Use the model's own loss (outputs.loss).")
                factor += float(mean)
        return factor

    def _rescale(self, factor: float) -> None:
        if abs(factor - self.scale) <= 1e-6 * abs(factor):
            return
        if factor == 0.0:
            raise ConfigurationError("Under pp_size > 1 the loss given to accelerator.backward does not depend on the "
                                     "model's outputs (its gradient through them is zero); pass outputs.loss.")
        if not self._fresh:
            raise ConfigurationError(
                f"Under pp_size > 1 the loss was scaled by {factor:g} before accelerator.backward, where the earlier "
                f"micro-steps of this gradient window used {self.scale:g}: the backward ran inside the model call, so "
                "scale the loss by the same factor on every step (or not at all). A new factor is taken at the first "
                "backward after optimizer.zero_grad() (set_to_none=True, the default).")
        for param in self.model.parameters():
            if param.grad is not None:
                param.grad.mul_(factor / self.scale)
        self.scale = factor


def cut_transformers_stage(model: nn.Module, split_points: list[str] | None, stage_index: int, num_stages: int,
                           full_weights: Callable[[], dict[str, torch.Tensor] | None] | None = None,
                           ) -> tuple[nn.Module, TransformersStage, list[Any]]:
    """Cut a transformers model (in place) into pipeline stage ``stage_index`` by its plan.

    ``full_weights`` gives the whole model's weights to a ``save_pretrained`` without a ``state_dict``
    (transformers' Trainer calls it so on the main process alone), or ``None`` where this process cannot
    read the other stages' weights alone.

    Returns:
        The cut model (full-model names), the module the pipeline stage runs, and the weights tied across
        stages as ``(parameter or None where another stage holds it, shape, dtype)`` in the same order on
        every stage.
    """
    model, stages, tied = cut_transformers_stages(model, split_points, [stage_index], num_stages, full_weights)
    return model, stages[stage_index], tied


def cut_transformers_stages(model: nn.Module, split_points: list[str] | None, kept: list[int], num_stages: int,
                            full_weights: Callable[[], dict[str, torch.Tensor] | None] | None = None,
                            ) -> tuple[nn.Module, dict[int, TransformersStage], list[Any]]:
    """Cut a transformers model (in place) into the pipeline stages ``kept`` (one process's) by its plan.

    With several stages, each runs a view of the cut model that holds only that stage's units (sharing
    the modules and parameters: :func:`~hasten.strategies.pipeline_schedules.stage_views`).

    Returns:
        The cut model (the kept stages' units, full-model names), each kept stage's module, and the weights
        tied across stages as ``(parameter or None where no kept stage holds it, shape, dtype)`` in the same
        order on every process.

    Raises:
        ConfigurationError: several stages of a model whose ``forward`` was replaced on the instance (a
            stage's view would run the replacement over every stage's modules).
    """
    units = transformers_stage_units(model, split_points, num_stages)
    if len(kept) > 1 and "forward" in vars(model):
        raise ConfigurationError(
            f"{type(model).__name__}.forward was replaced on the model object (as some trainers do); a pipeline "
            "schedule with several stages per process cannot run it stage by stage: use pp_schedule='1F1B' or "
            "'GPipe'.")
    inner = wrapped_transformers_model(model)[0]
    if len(kept) > 1 and inner is not model:
        raise ConfigurationError(
            f"A PEFT-wrapped model ({type(model).__name__}) runs the schedules with one stage per process only (its "
            "adapters' save and forward are not checked over several stages per process): use pp_schedule='1F1B' "
            "or 'GPipe'.")
    tied = []
    for param, stages in _tied_weights(model, units):
        if not param.requires_grad:  # frozen (a PEFT model's base weights): no gradients to sum
            continue
        held = any(stage in kept for stage in stages)
        if held and stages[0] not in kept:  # the first holder's process counts it (clip_grad_norm_)
            setattr(param, PP_TIED_MIRROR, True)
        tied.append((param if held else None, param.shape, param.dtype))
    # A unit whose weights a kept stage holds anyway (the embedding beside a tied head) stays with that
    # stage, costing nothing: the process then knows the weight under all its names, as the full model does.
    mine = {stage: {id(p) for name, owner in units if owner == stage for p in model.get_submodule(name).parameters()}
            for stage in kept}
    relabelled = []
    for name, stage in units:
        params = {id(p) for p in model.get_submodule(name).parameters()}
        holder = next((k for k in kept if params and params <= mine[k]), stage) if stage not in kept else stage
        relabelled.append((name, holder))
    skeletons = {name: model.get_submodule(name) for name, stage in relabelled if stage not in kept}
    if len(kept) == 1:
        skip_other_stages(model, relabelled, kept[0])
        stage_modules = {kept[0]: TransformersStage(model, kept[0], num_stages)}
    else:
        views = stage_views(model, relabelled, kept)
        stage_modules = {index: TransformersStage(view, index, num_stages) for index, view in views.items()}
    if inner is not model:
        save_adapters_of_every_stage(model, {name: to_meta(unit) for name, unit in skeletons.items()})
        # The transformers model (merge_and_unload returns it) holds one stage too; the stages' weights are
        # the wrapper's (its names), so without a state_dict it refuses.
        guard_save_pretrained(inner, lambda: None)
    guard_save_pretrained(model, full_weights or (lambda: None))
    return model, stage_modules, tied


__all__ = ["PP_TIED_MIRROR", "TransformersPipelineCall", "TransformersStage", "cut_transformers_stage",
           "cut_transformers_stages", "transformers_pp_plan", "transformers_split_points", "transformers_stage_units",
           "wrapped_transformers_model"]
