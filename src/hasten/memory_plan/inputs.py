"""What a memory plan is asked about, checked before anything runs: the layout, the model, the batch, the optimizer.

Every check raises :class:`PlanError` (a ``ConfigurationError``) naming the value and the fix, so the CLI
prints one line and exits 2.
"""

from __future__ import annotations

import copy
import importlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hasten.exceptions import ConfigurationError

#: Layout keys and what each one shards (ParallelismConfig sizes, or a DeepSpeed ZeRO stage).
LAYOUT_KEYS = ("dp_replicate", "dp_shard", "tp", "cp", "zero")
OPTIMIZERS = ("adamw", "adam", "sgd")
MIXED_PRECISIONS = ("no", "bf16", "fp16")


class PlanError(ConfigurationError):
    """A memory plan cannot be made from what was given; the message names the value and the fix."""


@dataclass(frozen=True)
class Layout:
    """How the processes of a plan are arranged: ``dp_replicate`` copies, each sharded over ``dp_shard``,
    each of those ranks split ``tp`` ways by tensor parallelism (ParallelismConfig's sizes)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    zero: int = 0  # a DeepSpeed ZeRO stage (2 or 3) over all ``dp_replicate`` processes; 0: none

    @property
    def sharded(self) -> bool:
        """True when FSDP2 prepares the model (``dp_shard > 1``, or tensor parallel, which hasten runs under
        ``fully_shard`` too); False for replication (DDP), DeepSpeed ZeRO or one process."""
        return self.dp_shard > 1 or self.tp > 1

    @property
    def n_dimensional(self) -> bool:
        """True when a real run takes hasten's N-D strategy on a multi-dimensional mesh: HSDP
        (``dp_replicate`` x ``dp_shard``) or anything with tensor parallel."""
        return self.tp > 1 or (self.dp_replicate > 1 and self.dp_shard > 1)

    @property
    def size(self) -> int:
        """The processes this layout covers."""
        return self.dp_replicate * self.dp_shard * self.tp

    def describe(self) -> str:
        """``'dp_shard=4'``, ``'dp_replicate=2,dp_shard=2'``, ``'dp_shard=2,tp=2'``, ``'zero=3'``, ``'single process'``."""
        if self.zero:
            return f"zero={self.zero}"
        sizes = (("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard), ("tp", self.tp))
        return ",".join(f"{k}={v}" for k, v in sizes if v > 1) or "single process"


def parse_layout(text: str | Mapping[str, int] | None, num_processes: int) -> Layout:
    """``'dp_shard=4'`` (or ``{"dp_shard": 4}``) for ``num_processes`` processes -> :class:`Layout`.

    No layout means replication over every process (DDP), as ``hasten launch`` does by default.

    Raises:
        PlanError: an unknown key, a size that is not a positive integer, sizes whose product is not
            ``num_processes``, a ZeRO stage other than 2 or 3, or context parallel.
    """
    if num_processes < 1:
        raise PlanError(f"num_processes={num_processes} must be at least 1.")
    sizes = _layout_sizes(text) if text else {"dp_replicate": num_processes}
    if sizes.get("cp", 1) > 1:
        raise PlanError(f"layout 'cp={sizes['cp']}' cannot be planned: context parallel shards the sequence inside "
                        "attention through torch's experimental context_parallel(), which does not run on fake "
                        "tensors; plan without cp (its activations per process are about 1/cp of the plan's).")
    if sizes.get("zero"):
        return _zero_layout(sizes, num_processes)
    layout = Layout(dp_replicate=sizes.get("dp_replicate", 1), dp_shard=sizes.get("dp_shard", 1),
                    tp=sizes.get("tp", 1))
    if layout.size != num_processes:
        raise PlanError(f"layout {layout.describe()!r} covers {layout.size} process(es), "
                        f"not --num_processes {num_processes}: make the sizes multiply to {num_processes} "
                        f"(e.g. dp_shard={num_processes}).")
    return layout


def _zero_layout(sizes: dict[str, int], num_processes: int) -> Layout:
    """``zero=2`` / ``zero=3``: DeepSpeed ZeRO over all processes (no other size goes with it)."""
    stage = sizes["zero"]
    if stage not in (2, 3):
        raise PlanError(f"layout 'zero={stage}' cannot be planned: hasten plans ZeRO stages 2 and 3 "
                        "(write zero=2 or zero=3).")
    others = {k: v for k, v in sizes.items() if k != "zero" and v > 1}
    if others:
        named = ",".join(f"{k}={v}" for k, v in others.items())
        raise PlanError(f"layout 'zero={stage}' shards over every process and takes no other size, but {named!r} "
                        f"was given with it: write --layout zero={stage} alone.")
    return Layout(dp_replicate=num_processes, zero=stage)


def _layout_sizes(text: str | Mapping[str, int]) -> dict[str, int]:
    items = text.items() if isinstance(text, Mapping) else (
        part.partition("=")[::2] for part in text.replace(" ", "").split(",") if part)
    sizes: dict[str, int] = {}
    for key, value in items:
        key = str(key).removesuffix("_size")
        if key not in LAYOUT_KEYS:
            raise PlanError(f"layout key {key!r} is unknown: use {', '.join(LAYOUT_KEYS)} (e.g. 'dp_shard=4').")
        try:
            size = int(value)
        except (TypeError, ValueError):
            size = -1
        if size < 1 and not (key == "zero" and size == 0):
            raise PlanError(f"layout {key}={value!r} is not a positive integer: write e.g. '{key}=2'.")
        sizes[key] = size
    return sizes


def make_optimizer_factory(name: str | Callable[[Any], torch.optim.Optimizer], *, lr: float = 1e-3,
                           momentum: float = 0.0, foreach: bool | None = None
                           ) -> tuple[str, Callable[[Any], torch.optim.Optimizer]]:
    """``'adamw'``/``'adam'``/``'sgd'`` (or a callable ``params -> Optimizer``) -> ``(label, factory)``.

    ``foreach`` as torch chooses it on the planned device (multi-tensor on CUDA, per tensor on CPU):
    the two differ in their temporaries at the step.

    Raises:
        PlanError: an unknown optimizer name.
    """
    if callable(name):
        return getattr(name, "__name__", "custom"), name
    key = str(name).lower()
    if key == "adamw":
        return key, lambda params: torch.optim.AdamW(params, lr=lr, foreach=foreach)
    if key == "adam":
        return key, lambda params: torch.optim.Adam(params, lr=lr, foreach=foreach)
    if key == "sgd":
        label = f"sgd(momentum={momentum})" if momentum else "sgd"
        return label, lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum, foreach=foreach)
    raise PlanError(f"optimizer {name!r} is unknown: use one of {', '.join(OPTIMIZERS)} or pass a callable "
                    "params -> torch.optim.Optimizer.")


def build_model(model: Any, model_kwargs: Mapping[str, Any] | None = None) -> tuple[nn.Module, str]:
    """The model under the active fake mode, and a label: from an ``nn.Module`` on the meta device (copied),
    a factory (a callable returning one), a class path ``'pkg.module:Class'`` or a transformers config folder.

    Raises:
        PlanError: a module with real weights, a path that is neither a config folder nor an importable class,
            or a model that cannot be built offline.
    """
    kwargs = dict(model_kwargs or {})
    if isinstance(model, nn.Module):
        if any(not t.is_meta for t in (*model.parameters(), *model.buffers())):
            raise PlanError(f"{type(model).__name__} holds real weights: build it under hasten.init_empty_weights() "
                            "(the meta device) or pass a factory that builds it, so the plan allocates nothing.")
        built = copy.deepcopy(model).to_empty(device="cpu")
        return built, type(model).__name__
    if isinstance(model, (str, Path)) and _config_file(Path(model)) is not None:
        return _transformers_model(Path(model)), str(model)
    if isinstance(model, str):
        return _call(_import_class(model), kwargs, model), model
    if callable(model):
        return _call(model, kwargs, getattr(model, "__name__", type(model).__name__)), getattr(
            model, "__name__", type(model).__name__)
    raise PlanError(f"model {model!r} is not a module, a factory, a class path 'pkg.module:Class' or a folder "
                    "holding a transformers config.json.")


def _config_file(path: Path) -> Path | None:
    if path.is_file() and path.name.endswith(".json"):
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path / "config.json"
    return None


def _import_class(path: str) -> Callable[..., Any]:
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)  # type: ignore[no-any-return]
    except (ImportError, AttributeError, ValueError) as exc:
        raise PlanError(f"model {path!r} is neither a folder with a config.json nor an importable class "
                        f"({type(exc).__name__}: {exc}): pass 'pkg.module:Class' or a local config folder.") from None


def _call(factory: Callable[..., Any], kwargs: dict[str, Any], label: str) -> nn.Module:
    try:
        built = factory(**kwargs)
    except Exception as exc:  # noqa: BLE001 - any failure of the user's constructor becomes one line
        raise PlanError(f"building model {label!r} with kwargs {json.dumps(kwargs, default=str)} failed "
                        f"({type(exc).__name__}: {exc}); fix the kwargs (--model_kwargs).") from None
    if not isinstance(built, nn.Module):
        raise PlanError(f"model {label!r} built a {type(built).__name__}, not a torch.nn.Module.")
    return built


def _transformers_model(path: Path) -> nn.Module:
    try:
        import transformers
    except ImportError:
        raise PlanError(f"{path} is a transformers config but transformers is not installed: "
                        "pip install transformers.") from None
    config_file = _config_file(path)
    assert config_file is not None
    try:
        config = transformers.AutoConfig.from_pretrained(str(config_file.parent), local_files_only=True)
        architectures = getattr(config, "architectures", None) or []
        auto = transformers.AutoModelForCausalLM if any(a.endswith("ForCausalLM") for a in architectures) \
            else transformers.AutoModel
        return auto.from_config(config)  # type: ignore[no-any-return]
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds; each becomes one line
        raise PlanError(f"cannot build the transformers model of {config_file} offline "
                        f"({type(exc).__name__}: {exc}); check its config.json (model_type, sizes).") from None


def batch_spec(batch: Any, batch_size: int | None, seq_len: int | None,
               input_shape: tuple[int, ...] | None = None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The shapes and dtypes of one process's batch, by keyword: from a sample (tensor or dict of tensors,
    real, meta or fake), else token ids ``(batch_size, seq_len)`` as ``input_ids`` and ``labels``, else a
    float ``(batch_size, *input_shape)`` tensor as ``input``.

    Raises:
        PlanError: no batch, or a sample that is not tensors.
    """
    if batch is not None:
        items = batch.items() if isinstance(batch, Mapping) else [("input", batch)]
        spec = {}
        for key, value in items:
            if not isinstance(value, torch.Tensor):
                raise PlanError(f"batch[{key!r}] is a {type(value).__name__}, not a tensor: pass tensors (meta "
                                "tensors are fine, e.g. torch.empty(8, 128, device='meta')).")
            spec[str(key)] = (tuple(value.shape), value.dtype)
        return spec
    if batch_size is None or batch_size < 1:
        raise PlanError(f"the batch has no shape (batch_size={batch_size}): pass --batch_size B with --seq_len S "
                        "(token ids) or --input_shape, or batch=<a sample tensor>.")
    if seq_len is not None:
        if seq_len < 1:
            raise PlanError(f"seq_len={seq_len} must be a positive number of tokens.")
        ids = ((batch_size, seq_len), torch.long)
        return {"input_ids": ids, "labels": ids}
    if input_shape:
        return {"input": ((batch_size, *input_shape), torch.float32)}
    raise PlanError(f"batch_size={batch_size} without a sample shape: add --seq_len S (token ids) or "
                    "--input_shape D1,D2 (a float input of shape (B, D1, D2)).")


def default_loss(output: Any) -> torch.Tensor:
    """The output's ``.loss`` (a transformers model given labels), else the mean of the (first) output tensor."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, (tuple, list)) and output:
        output = output[0]
    if isinstance(output, Mapping):
        output = next(iter(output.values()))
    if not isinstance(output, torch.Tensor):
        raise PlanError(f"the model returned a {type(output).__name__} with no loss: pass loss_fn=(output, batch) "
                        "-> loss, or labels in the batch.")
    return output.mean()
