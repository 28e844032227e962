"""The one-GPU tier: what a user with a single CUDA GPU meets, checked on the GPU (skipped on CPU machines).

The multi-GPU contract rows (``strategies/test_contract_cuda.py``) need as many GPUs as ranks; these run
on one: device placement and mixed precision against an fp32 CPU reference, FSDP2 on a private one-rank
NCCL group with a bit-exact resume, ``torch.compile`` on the GPU, and big-model dispatch split between
the GPU and the CPU.

Tolerances: fp32 on the GPU differs from the CPU only in summation order (~1e-6 after a few SGD steps;
TF32 matmuls are off by default in torch); bf16 keeps 8 bits of mantissa (relative error ~4e-3 per
operation), fp16 11 bits, so after 4 steps of lr 0.1 on this small model the weights stay within 3e-2
of fp32 — far below what a skipped step or an unscaled fp16 gradient does (~1e-1 or NaN).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hasten import (
    Accelerator,
    FullyShardedDataParallelPlugin,
    init_empty_weights,
    load_checkpoint_and_dispatch,
)
from hasten.state import reset_state

pytestmark = [pytest.mark.requires_cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

STEPS = 4
LR = 0.1


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator)) for _ in range(STEPS)]


def _cpu_reference() -> dict[str, torch.Tensor]:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in _batches():
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(accelerator: Accelerator, model: nn.Module, optimizer: torch.optim.Optimizer,
           batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for x, y in batches:
        x, y = x.to(accelerator.device), y.to(accelerator.device)
        with accelerator.autocast():
            loss = nn.functional.mse_loss(model(x).float(), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize(("precision", "atol"), [("no", 1e-5), ("bf16", 3e-2), ("fp16", 3e-2)])
def test_one_gpu_training_places_on_cuda_and_matches_fp32_on_cpu(precision, atol):
    reset_state()
    accelerator = Accelerator(mixed_precision=precision)
    assert accelerator.device.type == "cuda"
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert all(p.device.type == "cuda" for p in model.parameters())
    if precision == "fp16":
        assert accelerator.scaler is not None and accelerator.scaler.is_enabled()
    _train(accelerator, model, optimizer, _batches())
    got = {k: v.detach().float().cpu() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    for name, expected in _cpu_reference().items():
        torch.testing.assert_close(got[name], expected, atol=atol, rtol=0, msg=f"{precision}: {name}")
    accelerator.end_training()


def test_fsdp2_on_one_gpu_uses_nccl_and_resumes_bit_exactly(tmp_path: Path):
    reset_state()
    plugin = FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT")
    accelerator = Accelerator(fsdp_plugin=plugin)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    try:
        assert dist.is_initialized() and "nccl" in str(dist.get_backend()), dist.get_backend()
    except AssertionError:
        accelerator.end_training()
        raise
    batches = _batches()
    _train(accelerator, model, optimizer, batches[:2])
    accelerator.save_state(str(tmp_path / "ckpt"))
    _train(accelerator, model, optimizer, batches[2:])
    uninterrupted = {k: v.full_tensor().cpu() if hasattr(v, "full_tensor") else v.cpu()
                     for k, v in model.state_dict().items()}
    accelerator.load_state(str(tmp_path / "ckpt"))
    _train(accelerator, model, optimizer, batches[2:])
    resumed = {k: v.full_tensor().cpu() if hasattr(v, "full_tensor") else v.cpu() for k, v in model.state_dict().items()}
    for name, tensor in uninterrupted.items():
        assert torch.equal(tensor, resumed[name]), name
    accelerator.end_training()


def test_compiled_model_on_gpu_matches_eager():
    reset_state()
    accelerator = Accelerator(dynamo_backend="inductor")
    model = accelerator.prepare(_model())
    x = torch.randn(8, 16, device=accelerator.device)
    eager = _model().to(accelerator.device)(x)
    torch.testing.assert_close(model(x), eager, atol=1e-5, rtol=1e-5)
    accelerator.end_training()


def test_big_model_dispatch_splits_between_gpu_and_cpu(tmp_path: Path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    reference = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(tmp_path / "model.safetensors"))
    with init_empty_weights():
        empty = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
    # Room for about half of the 8 layers (257 KiB each) on the GPU: the rest must go to the CPU.
    model = load_checkpoint_and_dispatch(empty, str(tmp_path / "model.safetensors"), device_map="auto",
                                         max_memory={0: 4 * 264_000, "cpu": 1 << 30})
    placed = set(model.hf_device_map.values())
    assert 0 in placed or "cuda:0" in placed, model.hf_device_map
    assert "cpu" in placed, model.hf_device_map
    x = torch.randn(4, 256)
    torch.testing.assert_close(model(x.cuda()).cpu(), reference(x), atol=1e-5, rtol=1e-5)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_async_save_of_a_cuda_model_stages_in_pinned_memory_and_equals_a_sync_save(tmp_path: Path):
    reset_state()
    accelerator = Accelerator()
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    batches = _batches()
    _train(accelerator, model, optimizer, batches[:2])
    accelerator.save_state(str(tmp_path / "sync"))
    accelerator.save_state(str(tmp_path / "async"), async_save=True)
    buffers = accelerator._background_saver.buffers
    pinned = [storage for (_, pinned), storage in buffers._used if pinned]
    # the weights and AdamW's moments come from the GPU: pinned buffers; the generators' states stay plain
    assert len(pinned) >= 3 * len(list(model.parameters()))
    assert all(torch.empty(0, dtype=torch.uint8).set_(storage).is_pinned() for storage in pinned)
    saved_weights = {k: v.detach().cpu().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    _train(accelerator, model, optimizer, batches[2:])  # in place on the GPU, while the background writes
    accelerator.wait_for_checkpoint()
    sync, asynchronous = _files(tmp_path / "sync"), _files(tmp_path / "async")
    assert sync.keys() == asynchronous.keys() and "optimizer.bin" in sync
    for name in sync:  # the optimizer's CUDA tensors keep their "cuda:0" location tags in the pinned copies
        assert sync[name] == asynchronous[name], name
    accelerator.load_state(str(tmp_path / "async"))
    state = optimizer.state_dict()["state"]
    assert all(t.device.type == "cuda" for s in state.values() for t in s.values() if t.dim() > 0)
    for name, tensor in accelerator.unwrap_model(model).state_dict().items():
        assert tensor.device.type == "cuda" and torch.equal(tensor.cpu(), saved_weights[name]), name
    accelerator.end_training()
    assert buffers.nbytes == 0


def test_async_sharded_save_of_fsdp2_on_one_gpu_stages_local_shards_in_pinned_memory(tmp_path: Path):
    reset_state()
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT"))
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    batches = _batches()
    _train(accelerator, model, optimizer, batches[:2])
    accelerator.save_state(str(tmp_path / "sync"))
    at_call = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
    accelerator.save_state(str(tmp_path / "async"), async_save=True)
    buffers = accelerator._background_saver.buffers
    pinned = [storage for (_, pinned), storage in buffers._used if pinned]
    assert len(pinned) >= 3 * len(list(model.parameters()))  # the DTensors' local shards and moments
    _train(accelerator, model, optimizer, batches[2:])  # in place on the GPU, while the background writes
    accelerator.wait_for_checkpoint()
    sync, asynchronous = _files(tmp_path / "sync"), _files(tmp_path / "async")
    shards = [name for name in sync if name.endswith(".distcp")]
    assert len(shards) == 2 and all(sync[name] == asynchronous[name] for name in shards)  # DCP wrote the same shards
    accelerator.load_state(str(tmp_path / "async"))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor.full_tensor().cpu(), at_call[name]), name
    accelerator.end_training()
    assert buffers.nbytes == 0
