"""Predicted vs measured memory of one training step, per layout (``hasten.plan_memory``'s accuracy).

For each case the plan runs on fake tensors in a fake process group; the same step then runs for real
through ``Accelerator.prepare`` on 1, 2 or 4 forked gloo ranks, measured by torch's memory tracker in real
mode (``hasten.memory_plan.measure``). Printed per case: the planned and measured peak of the worst rank,
the error, and whether the plan answers "fits" right at budgets 15% above and 15% below the measured
peak; then the median and largest error. The peer, in the same run on the same cases: Accelerate's
``accelerate estimate-memory`` training figure (its ``estimate_training_usage`` peak for the model's size,
where Accelerate is installed, as in ``make bench``'s venv): one number per model and precision, for Adam at
batch size 1 on one process, whatever the layout, optimizer or batch.

    python benchmarks/bench_memory_plan.py            # every case (a few minutes on 2 cores)
    python benchmarks/bench_memory_plan.py --quick    # 1 and 2 ranks, tiny models only
    python benchmarks/bench_memory_plan.py --n-dimensional   # only HSDP and tensor parallel (2 and 4 ranks)
    python benchmarks/bench_memory_plan.py --zero     # only DeepSpeed ZeRO-2/3 on 2 ranks, against its engine
    python benchmarks/bench_memory_plan.py --large    # a ~110M-parameter Llama on 1 and 2 ranks (slow)

What "measured" means: the bytes of live tensor storages, as torch's tracker counts them on CPU. It does
not see the allocator's rounding and caching on a GPU, the CUDA context or NCCL's own buffers: leave a
margin of a few GiB for those when reading a plan against a GPU's capacity.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from hasten.memory_plan import format_bytes, plan_memory  # noqa: E402
from hasten.testing import preload_deepspeed, run_on_ranks  # noqa: E402


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class MLPNet(nn.Module):
    """A residual MLP (4 blocks of width 256): the plain-module case."""

    _no_split_modules = ["Block"]

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(256) for _ in range(4))
        self.head = nn.Linear(256, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


LLAMAS = {"llama-0.1M": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=256),
          "llama-9M": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                           num_key_value_heads=4, vocab_size=8192),
          # ~110M parameters (GPT-2 small's shape in Llama's layers): only with --large
          "llama-100M": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                             num_key_value_heads=12, vocab_size=32000)}

#: The --large cases: the ~100M-parameter Llama on 1 and 2 ranks, a few layouts each.
LARGE_CASES = {1: [("llama-100M", None, "bf16", "adamw", {})],
               2: [("llama-100M", "dp_replicate=2", "no", "adamw", {}),
                   ("llama-100M", "dp_shard=2", "bf16", "adamw", {}),
                   ("llama-100M", "dp_shard=2", "bf16", "adamw", {"activation_checkpointing": True}),
                   ("llama-100M", "zero=2", "bf16", "adamw", {}), ("llama-100M", "zero=3", "bf16", "adamw", {})]}


def _cases(world: int, quick: bool, n_dimensional: bool = False,
           zero_only: bool = False) -> list[tuple[str, str | None, str, str, dict[str, Any]]]:
    """(model, layout, mixed precision, optimizer, FSDP2 options) for ``world`` processes; with ``n_dimensional``
    only the HSDP and tensor-parallel ones, with ``zero_only`` only the DeepSpeed ones."""
    models = ["mlp", "llama-0.1M"] if quick else ["mlp", "llama-0.1M", "llama-9M"]
    cases: list[tuple[str, str | None, str, str, dict[str, Any]]] = []
    for model in models:
        if world == 1:
            cases += [] if n_dimensional else [(model, None, "no", "adamw", {}), (model, None, "bf16", "sgd", {})]
            continue
        ddp, shard = f"dp_replicate={world}", f"dp_shard={world}"
        if not n_dimensional:
            cases += [(model, ddp, "no", "adamw", {}), (model, ddp, "bf16", "sgd", {}),
                      (model, shard, "no", "adamw", {}), (model, shard, "bf16", "adamw", {}),
                      (model, shard, "bf16", "sgd", {"reshard_after_forward": False}),
                      (model, shard, "bf16", "adamw", {"activation_checkpointing": True})]
        cases += _n_dimensional_cases(model, world)
        if not n_dimensional and world == 2 and (zero_only or not quick):  # --quick stays short: no engines
            cases += _zero_cases(model)
    if zero_only:
        cases = [case for case in cases if case[1] and case[1].startswith("zero")]
    return cases


#: The DeepSpeed sizes of the ZeRO cases: the Llamas' "auto" (filled from hidden_size, as hasten and Accelerate
#: fill them), the MLP's written out; ``"default"`` marks a case on DeepSpeed's own defaults (500M-element buckets).
ZERO_SIZES = {"llama": {"reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                        "stage3_param_persistence_threshold": "auto"},
              "mlp": {"reduce_bucket_size": 200_000, "stage3_prefetch_bucket_size": 200_000,
                      "stage3_param_persistence_threshold": 1000}}


def _zero_cases(model: str) -> list[tuple[str, str | None, str, str, dict[str, Any]]]:
    """DeepSpeed ZeRO-2 and ZeRO-3 (its engine, on gloo), fp32 and bf16, AdamW and SGD; one on DeepSpeed's
    default bucket sizes."""
    cases: list[tuple[str, str | None, str, str, dict[str, Any]]] = [
        (model, "zero=2", "no", "adamw", {}), (model, "zero=2", "bf16", "sgd", {}),
        (model, "zero=3", "no", "adamw", {}), (model, "zero=3", "bf16", "adamw", {})]
    if model == "mlp":
        cases += [(model, "zero=2", "bf16", "adamw", {"default": True}), (model, "zero=3", "no", "sgd", {"default": True})]
    return cases


def _zero_config(case: tuple) -> dict[str, Any]:
    """The case's DeepSpeed config (what the real run gets, and what the plan reads its sizes from)."""
    model, layout, _, _, options = case
    sizes = {} if options.get("default") else ZERO_SIZES["mlp" if model == "mlp" else "llama"]
    return {"train_micro_batch_size_per_gpu": _batch(model)[next(iter(_batch(model)))].shape[0],
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": int(layout.split("=")[1]), **sizes}}


def _n_dimensional_cases(model: str, world: int) -> list[tuple[str, str | None, str, str, dict[str, Any]]]:
    """HSDP on 4 ranks (a 2-D mesh); tensor parallel on the Llamas' own plan: tp=2 on 2 ranks, FSDP2 + TP and
    DDP + TP on 4."""
    tensor_parallel = model != "mlp"  # the MLP has no tensor-parallel plan
    if world == 2:
        return [(model, "tp=2", "bf16", "adamw", {}), (model, "tp=2", "no", "sgd", {})] if tensor_parallel else []
    hsdp = "dp_replicate=2,dp_shard=2"
    cases: list[tuple[str, str | None, str, str, dict[str, Any]]] = [
        (model, hsdp, "no", "adamw", {}), (model, hsdp, "bf16", "sgd", {"reshard_after_forward": False})]
    if tensor_parallel:
        cases += [(model, "dp_shard=2,tp=2", "bf16", "adamw", {}), (model, "dp_shard=2,tp=2", "no", "sgd", {}),
                  (model, "dp_replicate=2,tp=2", "bf16", "adamw", {})]
    return cases


def _build(model: str, folder: str) -> nn.Module:
    if model == "mlp":
        return MLPNet()
    import transformers

    return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(f"{folder}/{model}"))


def _batch(model: str) -> dict[str, torch.Tensor]:
    if model == "mlp":
        return {"input": torch.randn(64, 256)}
    ids = torch.randint(0, 256, (4, 128))
    return {"input_ids": ids, "labels": ids}


def _measure(cases: list, folder: str) -> list:
    from hasten import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig
    from hasten.memory_plan.inputs import make_optimizer_factory
    from hasten.memory_plan.measure import measure_step_memory
    from hasten.state import reset_state

    results = []
    for case in cases:
        model, layout, precision, optimizer, options = case
        reset_state()
        if layout and layout.startswith("zero"):
            results.append(_measure_zero(case, folder))
            continue
        plugin, config = None, None
        if layout and ("dp_shard" in layout or "tp" in layout):
            plugin = FullyShardedDataParallelPlugin(auto_wrap_policy="transformer_based_wrap", **options)
        if layout and ("tp" in layout or "," in layout):  # HSDP and TP: the N-D strategy on the layout's mesh
            sizes = dict(part.split("=") for part in layout.split(","))
            config = ParallelismConfig(**{f"{key}_size": int(value) for key, value in sizes.items()})
        accelerator = Accelerator(mixed_precision=precision, fsdp_plugin=plugin, parallelism_config=config)
        _, make = make_optimizer_factory(optimizer, foreach=False)
        results.append(measure_step_memory(accelerator, _build(model, folder), make, _batch(model)))
    return results


def _measure_zero(case: tuple, folder: str) -> Any:
    """The step through DeepSpeed's engine (its ZeRO optimizer wrapping torch's), as a loop under it runs it:
    16-bit float inputs under bf16, as the engine casts the module and adds no autocast."""
    from hasten import Accelerator
    from hasten.config.plugins.deepspeed import DeepSpeedPlugin
    from hasten.memory_plan.inputs import make_optimizer_factory
    from hasten.memory_plan.measure import measure_step_memory

    model, _, precision, optimizer, _ = case
    plugin = DeepSpeedPlugin(hf_ds_config=_zero_config(case))
    accelerator = Accelerator(mixed_precision=precision, deepspeed_plugin=plugin)
    _, make = make_optimizer_factory(optimizer, foreach=False)
    batch = {k: v.to(torch.bfloat16) if precision == "bf16" and v.is_floating_point() else v
             for k, v in _batch(model).items()}
    return measure_step_memory(accelerator, _build(model, folder), make, batch)


def _plan(case: tuple, world: int, folder: str) -> Any:
    model, layout, precision, optimizer, options = case
    source: Any = MLPNet if model == "mlp" else f"{folder}/{model}"
    batch = {key: torch.empty(value.shape, dtype=value.dtype, device="meta") for key, value in _batch(model).items()}
    batch_arg: Any = batch["input"] if model == "mlp" else batch
    if layout and layout.startswith("zero"):
        return plan_memory(source, batch=batch_arg, num_processes=world, layout=layout, mixed_precision=precision,
                           optimizer=optimizer, device_type="cpu", deepspeed_config=_zero_config(case))
    return plan_memory(source, batch=batch_arg, num_processes=world, layout=layout, mixed_precision=precision,
                       optimizer=optimizer, device_type="cpu", **options)


def _accelerate_estimate(model: str, folder: str, precision: str) -> int | None:
    """Accelerate's ``estimate-memory`` training peak for ``model`` (None without Accelerate installed)."""
    try:
        from accelerate.commands.estimate import estimate_training_usage
        from accelerate.utils import calculate_maximum_sizes
    except ImportError:
        return None
    total_size, _ = calculate_maximum_sizes(_build(model, folder))
    return int(max(estimate_training_usage(total_size, "bfloat16" if precision == "bf16" else "float32").values()))


def _summary(name: str, errors: list[float], wrong_answers: int) -> str:
    return (f"{name}: {len(errors)} cases, median |error| {statistics.median(errors):.2%}, largest {max(errors):.2%}, "
            f"wrong fits answers {wrong_answers}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 and 2 ranks, the two tiny models")
    parser.add_argument("--n-dimensional", action="store_true", help="only the HSDP and tensor-parallel cases")
    parser.add_argument("--zero", action="store_true", help="only the DeepSpeed ZeRO-2/3 cases (2 ranks)")
    parser.add_argument("--large", action="store_true", help="only the ~100M-parameter Llama (1 and 2 ranks)")
    args = parser.parse_args(argv)
    import transformers

    errors, wrong_answers, peer_errors, peer_wrong = [], 0, [], 0
    print(f"{'model':11} {'ranks':>5} {'layout':25} {'precision':9} {'optimizer':9} {'options':26} "
          f"{'planned':>11} {'measured':>11} {'error':>7}  fits@+15%/-15%  {'accelerate':>11} {'error':>8}  fits")
    with tempfile.TemporaryDirectory() as folder:
        for name, sizes in LLAMAS.items():
            transformers.LlamaConfig(**sizes, architectures=["LlamaForCausalLM"]).save_pretrained(f"{folder}/{name}")
        for world in ((1, 2) if args.quick else (1, 2, 4)):
            cases = LARGE_CASES.get(world, []) if args.large else _cases(world, args.quick, args.n_dimensional,
                                                                         args.zero)
            if not cases:
                continue
            if any(case[1] and case[1].startswith("zero") for case in cases):
                preload_deepspeed()
            measured = run_on_ranks(_measure, world_size=world, args=(cases, folder), timeout=1800)
            for index, case in enumerate(cases):
                plan = _plan(case, world, folder)
                real = max(rank[index].peak_bytes for rank in measured)
                error = (plan.peak_bytes - real) / real
                answers = (plan.fits(int(real * 1.15)), not plan.fits(int(real * 0.85)))
                wrong_answers += answers.count(False)
                errors.append(abs(error))
                options = ",".join(f"{k}={v}" for k, v in case[4].items()) or "-"
                peer = _accelerate_estimate(case[0], folder, case[2])
                peer_text = "not installed"
                if peer is not None:
                    peer_error = (peer - real) / real
                    peer_answers = (peer <= real * 1.15, peer > real * 0.85)  # Accelerate's "fits" at each budget
                    peer_wrong += peer_answers.count(False)
                    peer_errors.append(abs(peer_error))
                    peer_text = (f"{format_bytes(peer):>11} {peer_error:+8.2%}  "
                                 f"{'right' if all(peer_answers) else 'WRONG'}")
                print(f"{case[0]:11} {world:5} {case[1] or 'single':25} {case[2]:9} {case[3]:9} {options:26} "
                      f"{format_bytes(plan.peak_bytes):>11} {format_bytes(real):>11} {error:+7.2%}  "
                      f"{'right' if all(answers) else 'WRONG':14}  {peer_text}")
    print(_summary("hasten plan_memory", errors, wrong_answers))
    if peer_errors:
        print(_summary("accelerate estimate-memory", peer_errors, peer_wrong))
    return 0


if __name__ == "__main__":
    sys.exit(main())
