"""Names that hasten used to refuse though no engine was missing (issue 27): Accelerate's checkpoint
functions and its older tensor-parallel plugin now run. (Pipeline inference: tests/big_modeling/test_pippy.py.)"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from hasten.testing import run_on_ranks


def test_save_and_load_accelerator_state_round_trip(tmp_path):
    """As Accelerate's: model weights, optimizer, scheduler and this process's generators come back, and
    ``load_accelerator_state`` returns the saved step."""
    from hasten import PartialState
    from hasten.checkpointing import load_accelerator_state, save_accelerator_state

    PartialState()
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    scheduler.step()
    folder = save_accelerator_state(tmp_path, [model.state_dict()], [optimizer], [scheduler], [], 0, 7)
    assert sorted(p.name for p in folder.iterdir()) == ["model.safetensors", "optimizer.bin", "random_states_0.pkl",
                                                        "scheduler.bin"]
    expected_draw = torch.rand(3)
    other = nn.Linear(3, 2)
    other_optimizer = torch.optim.Adam(other.parameters())
    other_scheduler = torch.optim.lr_scheduler.StepLR(other_optimizer, 1)
    assert load_accelerator_state(tmp_path, [other], [other_optimizer], [other_scheduler], [], 0) == {"step": 7}
    assert torch.equal(torch.rand(3), expected_draw)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
    assert other_optimizer.state_dict()["state"][0]["step"] == 1 and other_scheduler.last_epoch == 1


def _tp_plugin_run():
    from hasten import Accelerator
    from hasten.utils import TorchTensorParallelPlugin

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator = Accelerator(cpu=True, torch_tp_plugin=TorchTensorParallelPlugin(tp_size=2))
    deprecated = any(issubclass(w.category, FutureWarning) and "ParallelismConfig" in str(w.message) for w in caught)
    return accelerator.parallelism_config.tp_size, accelerator.state.device_mesh["tp"].size(), deprecated


def test_torch_tensor_parallel_plugin_runs_as_parallelism_config_tp_size():
    """Accelerate 1.15 maps ``torch_tp_plugin`` onto ``ParallelismConfig(tp_size=...)`` with a FutureWarning."""
    assert run_on_ranks(_tp_plugin_run, world_size=2) == [(2, 2, True), (2, 2, True)]
