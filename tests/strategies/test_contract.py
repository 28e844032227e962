"""The strategy contract: one suite that every strategy passes (single, DDP, FSDP2, DeepSpeed and the N-D ones).

Each row runs the ordinary Accelerate loop (prepare, accumulate, backward, clip, step, save_state,
load_state, end_training) and checks it against ground truth computed on the same rank with plain
torch: one process training on the whole global batch. The rows differ only in how the
``Accelerator`` is built; the bodies are shared, so a new strategy (the N-D ones later) is one row.

Tolerances. Training: DDP, FSDP2 and DeepSpeed average gradients over ranks (each rank's mean loss,
then the mean over ranks) where the reference takes one mean over the whole batch, and they compute
the clipping norm over buckets or shards: the same fp32 numbers summed in another order, ~1e-7
relative per operation. SGD with lr 0.1 over 3 steps keeps that below ~1e-6, so ``ATOL = 1e-5`` is
10x the noise and 1000x below a real mistake (a missed or doubled step, an un-averaged or dropped
gradient moves weights by ~1e-2). The N-D rows (HSDP 2x2, DDP x TP 2x2, FSDP2 x TP 2x2 on 4 ranks,
HSDP x TP 2x2x2 on 8) add tensor-parallel matmuls split over two ranks and summed by an all-reduce:
the same order-of-summation noise, same bound. Under TP both ranks of a group read the same batch: batches follow the
data-parallel rank. Resume: the resumed run replays the very same operations on the
same numbers as the uninterrupted one, so it must be bit-exact (``torch.equal``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hasten import Accelerator, DeepSpeedPlugin, FullyShardedDataParallelPlugin, ParallelismConfig
from hasten.exceptions import CheckpointError
from hasten.state import reset_state
from hasten.utils import TorchTensorParallelConfig

LR = 0.1
CLIP = 0.3  # small enough that clipping really acts on these gradients (checked below)
ACCUMULATION = 2
MICRO_STEPS = 6  # 3 optimizer steps
BATCH = 4  # per rank and micro-step
ATOL = 1e-5

_RANKS = {"single": [], "ddp": [pytest.mark.world_size(2)], "fsdp2": [pytest.mark.world_size(2)],
          "deepspeed": [pytest.mark.world_size(2, timeout=280)],
          "hsdp": [pytest.mark.world_size(4, timeout=280)], "ddp_tp": [pytest.mark.world_size(4, timeout=280)],
          "fsdp2_tp": [pytest.mark.world_size(4, timeout=280)],
          "hsdp_tp": [pytest.mark.world_size(8, timeout=280)]}
#: The N-D rows: their ParallelismConfig sizes (dp_replicate, dp_shard, tp); the TP plan splits the
#: first Linear by output columns and the second by input rows (nn.Sequential children by index).
_ND = {"hsdp": (2, 2, 1), "ddp_tp": (2, 1, 2), "fsdp2_tp": (1, 2, 2), "hsdp_tp": (2, 2, 2)}
TP_PLAN = {"0": "colwise", "2": "rowwise"}


def _rows(known_bugs: dict[str, str] | None = None) -> list:
    """One row per strategy; ``known_bugs`` marks rows that fail today (strict: they must fail)."""
    bugs = known_bugs or {}
    return [pytest.param(kind, id=kind, marks=marks + ([pytest.mark.xfail(strict=True, reason=bugs[kind])]
                                                         if kind in bugs else []))
            for kind, marks in _RANKS.items()]


ROWS = _rows()
#: DeepSpeed keeps partial gradients in its own partitioned buffers, outside its checkpoint: a save
#: inside an accumulation window is refused clearly instead of resuming differently.
REFUSES_MID_WINDOW_SAVE = {"deepspeed"}

pytestmark = pytest.mark.usefixtures("deepspeed_in_parent")  # tests/conftest.py


def _accelerator(kind: str, **kwargs) -> Accelerator:
    reset_state()
    _KIND[0] = kind
    if kind == "fsdp2":
        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT")
    elif kind == "deepspeed":
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config={
            "zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": BATCH,
            "gradient_accumulation_steps": ACCUMULATION, "gradient_clipping": CLIP})
    elif kind in _ND:
        replicate, shard, tp = _ND[kind]
        kwargs["parallelism_config"] = ParallelismConfig(
            dp_replicate_size=replicate, dp_shard_size=shard, tp_size=tp,
            tp_handler=TorchTensorParallelConfig(tp_plan=TP_PLAN) if tp > 1 else None)
    return Accelerator(cpu=ON_CPU[0], gradient_accumulation_steps=ACCUMULATION, **kwargs)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _world() -> tuple[int, int]:
    """``(data-parallel rank, data-parallel size)``: which batch this process reads, out of how many."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    tp = _ND.get(_KIND[0], (0, 0, 1))[2]
    return rank // tp, world // tp


_KIND = [""]  # the row being run (set by _accelerator/_reference, read by _world)
ON_CPU = [True]  # the GPU tier (test_contract_cuda.py) runs the same bodies with False, on CUDA/NCCL


def _global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-step ``step``'s whole batch: ``BATCH`` samples per rank of the run."""
    world = _world()[1]
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH * world, 6, generator=g), torch.randn(BATCH * world, 3, generator=g)


def _my_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    rank = _world()[0]
    x, y = _global_batch(step)
    return x[rank * BATCH:(rank + 1) * BATCH], y[rank * BATCH:(rank + 1) * BATCH]


def _reference(kind: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, the whole batch, plain torch: the weights and the pre-clip norm of every step."""
    _KIND[0] = kind
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    norms = []
    for step in range(MICRO_STEPS):
        x, y = _global_batch(step)
        (nn.functional.mse_loss(model(x), y) / ACCUMULATION).backward()
        if (step + 1) % ACCUMULATION == 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
            optimizer.step()
            optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def _loop(accelerator: Accelerator, model: nn.Module, optimizer, steps: range, norms: list[float] | None = None,
          save_after: int | None = None, folder: Path | None = None) -> None:
    for step in steps:
        x, y = (t.to(accelerator.device) for t in _my_batch(step))
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), CLIP)
                if norms is not None:
                    norms.append(float(norm))
            optimizer.step()
            optimizer.zero_grad()
        if save_after is not None and step == save_after:
            accelerator.save_state(folder)


def _prepared(kind: str, **kwargs) -> tuple[Accelerator, nn.Module, torch.optim.Optimizer]:
    accelerator = _accelerator(kind, **kwargs)
    model = _model()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    return accelerator, model, optimizer


def _weights(accelerator: Accelerator, model: nn.Module) -> dict[str, torch.Tensor]:
    """The full weights on the main process (every process must call it: sharded strategies gather)."""
    state = accelerator.get_state_dict(model)
    return {k: v.detach().float().cpu().clone() for k, v in state.items()}


@pytest.mark.parametrize("kind", ROWS)
def test_train_accumulate_clip_match_one_process_on_the_whole_batch(kind):
    reference, reference_norms = _reference(kind)
    assert all(norm > CLIP for norm in reference_norms)  # clipping really acts
    accelerator, model, optimizer = _prepared(kind)
    norms: list[float] = []
    _loop(accelerator, model, optimizer, range(MICRO_STEPS), norms)
    assert accelerator.step == MICRO_STEPS and accelerator.sync_gradients
    weights = _weights(accelerator, model)
    if accelerator.is_main_process:
        assert weights.keys() == reference.keys()
        diff = max((weights[k] - reference[k]).abs().max().item() for k in reference)
        assert diff < ATOL, f"{kind}: weights differ from the one-process reference by {diff}"
        assert norms == pytest.approx(reference_norms, abs=ATOL)
    # Teardown: the group hasten runs on is gone afterwards, and a second call is harmless.
    accelerator.end_training()
    assert not dist.is_initialized()
    accelerator.end_training()


@pytest.mark.parametrize("kind", ROWS)
def test_save_inside_an_accumulation_window_resumes_exactly(kind, tmp_path):
    folder = tmp_path / "mid_window"
    save_after = 2  # after the 3rd micro-step: the 2nd optimizer step is half accumulated
    accelerator, model, optimizer = _prepared(kind)
    if kind in REFUSES_MID_WINDOW_SAVE:
        _loop(accelerator, model, optimizer, range(save_after + 1))
        with pytest.raises(CheckpointError, match="inside a gradient-accumulation window.*sync_gradients"):
            accelerator.save_state(folder)
        assert not folder.exists() and not list(tmp_path.iterdir())  # refused before anything was written
        return
    _loop(accelerator, model, optimizer, range(MICRO_STEPS), save_after=save_after, folder=folder)
    uninterrupted = _weights(accelerator, model)

    accelerator, model, optimizer = _prepared(kind)  # a fresh run: new weights, nothing accumulated
    accelerator.load_state(folder)
    assert accelerator.step == save_after + 1 and not accelerator.sync_gradients
    _loop(accelerator, model, optimizer, range(save_after + 1, MICRO_STEPS))
    resumed = _weights(accelerator, model)
    if accelerator.is_main_process:
        assert resumed.keys() == uninterrupted.keys() and uninterrupted
        changed = [k for k in resumed if not torch.equal(resumed[k], uninterrupted[k])]
        assert not changed, f"{kind}: resumed != uninterrupted for {changed}"


@pytest.mark.parametrize("kind", ROWS)
def test_dynamo_backend_compiles_the_prepared_model(kind):
    accelerator, model, optimizer = _prepared(kind, dynamo_backend="eager")
    # torch.compile's wrapper, or (DeepSpeed) the engine that compiled its module in place
    assert isinstance(model, torch._dynamo.eval_frame.OptimizedModule) or getattr(model, "is_compiled", False), (
        type(model).__name__)
    plain_accelerator, plain, plain_optimizer = _prepared(kind)
    for step in range(ACCUMULATION):
        x, y = _my_batch(step)
        for acc, net, opt in ((accelerator, model, optimizer), (plain_accelerator, plain, plain_optimizer)):
            with acc.accumulate(net):
                acc.backward(nn.functional.mse_loss(net(x), y))
                opt.step()
                opt.zero_grad()
    compiled, reference = _weights(accelerator, model), _weights(plain_accelerator, plain)
    if accelerator.is_main_process:
        assert compiled.keys() == reference.keys()
        assert max((compiled[k] - reference[k]).abs().max().item() for k in reference) < ATOL


@pytest.mark.parametrize("kind", ROWS)
def test_the_state_answers_what_the_accelerator_answers(kind):
    """``AcceleratorState()`` reads the strategy, never copies: same engine, same plugins, same data rank."""
    from hasten.state import AcceleratorState

    accelerator = _accelerator(kind)
    state = AcceleratorState()
    assert state.is_fsdp2 == accelerator.is_fsdp2 == (kind in ("fsdp2", *_ND)), kind
    assert state.distributed_type == accelerator.distributed_type
    assert state.fsdp_plugin is getattr(accelerator._strategy, "fsdp_plugin", None)
    assert (state.fsdp_plugin is not None) == state.is_fsdp2
    assert state.deepspeed_plugin is accelerator.deepspeed_plugin
    assert (state.deepspeed_plugin is not None) == (kind == "deepspeed")
    # batches follow the mesh's dp dimension (tp ranks of one group read the same batch)
    rank, size = _world()
    assert accelerator._data_parallel_position() == (size, rank)
    accelerator.end_training()


def test_direct_step_path_only_where_the_strategy_and_precision_add_nothing():
    """The facade calls ``loss.backward``/``optimizer.step`` itself only when nothing would be skipped."""
    from hasten.precision import BF16Precision, FP16Precision, Precision
    from hasten.strategies import DDPStrategy, SingleDeviceStrategy, Strategy
    from hasten.strategies.base import plain_backward, plain_optimizer_step
    from hasten.utils.dataclasses import DistributedType

    cpu = torch.device("cpu")

    class Clipping(Strategy):  # a strategy adding its own work to the step must keep being called
        def backward(self, loss: torch.Tensor, **kwargs: object) -> None:
            super().backward(loss)

        def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: object = None) -> bool:
            return super().optimizer_step(optimizer, closure)

    for strategy in (SingleDeviceStrategy(cpu, Precision(), DistributedType.NO),
                     DDPStrategy(cpu, BF16Precision(), DistributedType.MULTI_CPU, 2)):
        assert strategy.direct_backward() and strategy.direct_optimizer_step()
        assert (strategy.backward_fn(), strategy.optimizer_step_fn()) == (plain_backward, plain_optimizer_step)
    for strategy in (SingleDeviceStrategy(cpu, FP16Precision(), DistributedType.NO),  # loss scaling, skipped steps
                     Clipping(cpu, Precision(), DistributedType.NO)):
        assert not strategy.direct_backward() and not strategy.direct_optimizer_step()
        assert strategy.backward_fn() == strategy.backward and strategy.optimizer_step_fn() == strategy.optimizer_step
