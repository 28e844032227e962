"""``hasten.plan_memory`` for DeepSpeed ZeRO-2/3, fp16 (GradScaler) and gradient accumulation, against the same
step measured on 2 real gloo ranks.

Ground truth: each rank runs the step for real through ``Accelerator.prepare`` (DeepSpeed's engine for ZeRO,
DDP/FSDP2 otherwise) and ``accelerator.accumulate``, with torch's memory tracker in real mode
(``hasten.memory_plan.measure``); the plan runs the same model, batch, optimizer and precision on fake tensors.

Tolerance: a ZeRO plan adds DeepSpeed's buffers by rule to the model's own fake forward and backward;
``benchmarks/bench_memory_plan.py --zero`` and these cases measured it within 2% (ZeRO-3's backward, where
DeepSpeed's reduce path holds a few per-parameter buffers the rule approximates), the rest within 0.2%.
``ZERO_TOLERANCE`` = 4% keeps room for that while anything the plan could miss is far larger: the reduce
bucket, the fp32 master partition and the optimizer state are each over 10% of these peaks. fp16 and
accumulation plans run the real step's code on fake tensors: ``PEAK_TOLERANCE`` = 2% as in test_memory_plan.
"""

from __future__ import annotations

import torch

from hasten.testing import run_on_ranks
from helpers.memory_models import TinyNet

ZERO_TOLERANCE = 0.04
PEAK_TOLERANCE = 0.02
BATCH = (64, 128)
#: Sizes small enough that the parameters, master copy and optimizer state matter next to the bucket.
ZERO_SIZES = {"reduce_bucket_size": 50_000, "stage3_prefetch_bucket_size": 50_000,
              "stage3_param_persistence_threshold": 1000}


# (layout, mixed precision, optimizer, gradient accumulation steps)
ZERO_CASES = [("zero=2", "no", "adamw", 1), ("zero=2", "bf16", "sgd", 1), ("zero=3", "no", "adamw", 1),
              ("zero=3", "bf16", "adamw", 1)]
STEP_CASES = [("dp_shard=2", "fp16", "adamw", 1), ("dp_replicate=2", "fp16", "sgd", 1),
              ("dp_shard=2", "no", "adamw", 2), ("dp_replicate=2", "bf16", "adamw", 3)]


def _zero_config(layout: str) -> dict:
    return {"train_micro_batch_size_per_gpu": BATCH[0], "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": int(layout.split("=")[1]), **ZERO_SIZES}}


def _measure(cases: list) -> list:
    from hasten import Accelerator, FullyShardedDataParallelPlugin
    from hasten.config.plugins.deepspeed import DeepSpeedPlugin
    from hasten.memory_plan.inputs import make_optimizer_factory
    from hasten.memory_plan.measure import measure_step_memory
    from hasten.state import reset_state

    results = []
    for layout, precision, optimizer, accumulation in cases:
        reset_state()
        x = torch.randn(*BATCH)
        if layout.startswith("zero"):
            accelerator = Accelerator(mixed_precision=precision,
                                      deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=_zero_config(layout)))
            x = x.to(torch.bfloat16) if precision == "bf16" else x  # the engine casts the module, not the inputs
        else:
            plugin = FullyShardedDataParallelPlugin(auto_wrap_policy="transformer_based_wrap") \
                if layout.startswith("dp_shard") else None
            accelerator = Accelerator(mixed_precision=precision, fsdp_plugin=plugin,
                                      gradient_accumulation_steps=accumulation)
        _, make = make_optimizer_factory(optimizer, foreach=False)
        results.append(measure_step_memory(accelerator, TinyNet(), make, {"input": x}))
    return results


def _plan(case: tuple):
    from hasten import plan_memory

    layout, precision, optimizer, accumulation = case
    zero = {"deepspeed_config": _zero_config(layout)} if layout.startswith("zero") else {}
    return plan_memory(TinyNet, batch=torch.empty(*BATCH, device="meta"), num_processes=2, layout=layout,
                       mixed_precision=precision, optimizer=optimizer, device_type="cpu",
                       gradient_accumulation_steps=accumulation, **zero)


def _errors(cases: list) -> list[tuple[tuple, float]]:
    measured = run_on_ranks(_measure, world_size=2, args=(cases,), timeout=600)
    found = []
    for index, case in enumerate(cases):
        plan = _plan(case)
        real = max(rank[index].peak_bytes for rank in measured)
        assert plan.peak_bytes == sum(plan.per_process[0].categories().values())
        found.append((case, (plan.peak_bytes - real) / real))
    return found


def test_zero_plans_match_deepspeed_on_two_gloo_ranks():
    from hasten.testing import preload_deepspeed

    preload_deepspeed()
    for case, error in _errors(ZERO_CASES):
        assert abs(error) <= ZERO_TOLERANCE, (case, error)


def test_fp16_and_accumulation_plans_match_real_steps():
    for case, error in _errors(STEP_CASES):
        assert abs(error) <= PEAK_TOLERANCE, (case, error)


def test_zero_shards_what_each_stage_shards():
    """ZeRO-2 keeps every parameter and shards the rest; ZeRO-3 shards the parameters too (here it keeps no
    gathered ones); ZeRO-2 holds the reduce bucket the config sizes."""
    from hasten import plan_memory

    def plan(stage: int, world: int, bucket: int = 1000):
        config = {"zero_optimization": {"reduce_bucket_size": bucket, "stage3_param_persistence_threshold": 0,
                                        "stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 0,
                                        "stage3_prefetch_bucket_size": 0}}  # ZeRO-3 gathers nothing ahead
        return plan_memory(TinyNet, batch=torch.empty(*BATCH, device="meta"), num_processes=world,
                           layout=f"zero={stage}", device_type="cpu", deepspeed_config=config).per_process[0]

    weights = sum(p.numel() * 4 for p in TinyNet().parameters())
    two, four = plan(2, 2), plan(2, 4)
    assert two.parameters == four.parameters == weights
    assert two.optimizer_state == 2 * four.optimizer_state == 3 * weights // 2  # fp32 master + Adam's two states
    assert plan(3, 2).parameters == 2 * plan(3, 4).parameters == weights // 2
    large_bucket = plan(2, 2, bucket=10**7)
    assert large_bucket.communication == 4 * 10**7 < large_bucket.peak_bytes  # fp32 gradients, one bucket
