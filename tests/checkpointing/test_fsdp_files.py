"""Accelerate's ``save_fsdp_model`` / ``load_fsdp_model`` / ``save_fsdp_optimizer`` / ``load_fsdp_optimizer`` on FSDP2.

Ground truth: a model and optimizer restored from the files equal the ones saved (every gathered tensor, Adam's
moments included), for both state-dict types, in Accelerate's file layout; a damaged file is refused with its
name and nothing runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from hasten import Accelerator
from hasten.config.plugins.fsdp import FullyShardedDataParallelPlugin
from hasten.testing import run_on_ranks


def _prepared(seed: int) -> tuple[Accelerator, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    accelerator = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def _step(accelerator: Accelerator, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(4, 6)).pow(2).mean()
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()


def _full(accelerator: Accelerator, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {"model": accelerator.get_state_dict(model),
            "optimizer": get_optimizer_state_dict(model, optimizer, options=options).get("state", {})}


def _round_trip(folder: str) -> list[str]:
    from hasten.utils.fsdp_utils import (
        load_fsdp_model,
        load_fsdp_optimizer,
        save_fsdp_model,
        save_fsdp_optimizer,
    )

    checked = []
    for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        accelerator, model, optimizer = _prepared(0)
        plugin = accelerator.state.fsdp_plugin
        plugin.set_state_dict_type(kind)
        torch.manual_seed(1 + accelerator.process_index)
        _step(accelerator, model, optimizer)
        target = f"{folder}/{kind}"
        save_fsdp_model(plugin, accelerator, model, target)
        save_fsdp_optimizer(plugin, accelerator, optimizer, model, target)
        saved = _full(accelerator, model, optimizer)
        _, fresh_model, fresh_optimizer = _prepared(5)  # other weights, no optimizer state yet
        load_fsdp_model(plugin, accelerator, fresh_model, target)
        load_fsdp_optimizer(plugin, accelerator, fresh_optimizer, fresh_model, target)
        loaded = _full(accelerator, fresh_model, fresh_optimizer)
        if accelerator.is_main_process:
            assert saved["model"] and saved["optimizer"]  # rank 0 holds the gathered state
            assert saved["model"].keys() == loaded["model"].keys()
            assert all(torch.equal(saved["model"][k], loaded["model"][k]) for k in saved["model"])
            for name, moments in saved["optimizer"].items():
                for key, value in moments.items():
                    assert torch.equal(torch.as_tensor(value), torch.as_tensor(loaded["optimizer"][name][key])), (
                        kind, name, key)
        checked.append(kind)
    return checked


def test_full_and_sharded_round_trip_in_accelerates_layout(tmp_path):
    results = run_on_ranks(_round_trip, world_size=2, args=(str(tmp_path),))
    assert results == [["FULL_STATE_DICT", "SHARDED_STATE_DICT"]] * 2
    full, sharded = tmp_path / "FULL_STATE_DICT", tmp_path / "SHARDED_STATE_DICT"
    assert sorted(p.name for p in full.iterdir()) == ["optimizer.bin", "pytorch_model_fsdp.bin"]
    assert sorted(p.name for p in sharded.iterdir()) == ["optimizer_0", "pytorch_model_fsdp_0"]
    assert (sharded / "pytorch_model_fsdp_0" / ".metadata").is_file()


def test_a_file_holding_code_is_refused(tmp_path):
    from hasten.checkpointing.fsdp_files import load_fsdp_model
    from hasten.exceptions import CheckpointError

    class Plugin:
        state_dict_type = "FULL_STATE_DICT"

    class OneProcess:
        process_index, num_processes = 0, 1

        def wait_for_everyone(self) -> None:
            pass

    torch.save({"weight": Path("x")}, tmp_path / "pytorch_model_fsdp.bin")  # a pickled non-tensor global
    with pytest.raises(CheckpointError, match="pytorch_model_fsdp.bin"):
        load_fsdp_model(Plugin(), OneProcess(), nn.Linear(1, 1), tmp_path)
    with pytest.raises(Exception, match="LOCAL_STATE_DICT is FSDP1"):
        Plugin.state_dict_type = "LOCAL_STATE_DICT"
        load_fsdp_model(Plugin(), OneProcess(), nn.Linear(1, 1), tmp_path)
