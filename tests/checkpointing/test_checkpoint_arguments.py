"""No argument of ``save_state``/``load_state`` (and their helpers) is dropped silently (issue 34, item 4).

Accelerate hands ``save_state(**kwargs)`` to DeepSpeed's ``engine.save_checkpoint`` and
``load_state(**kwargs)`` to the models' loading (``strict``) or DeepSpeed's ``engine.load_checkpoint``;
``load_kwargs`` are its ``torch.load`` options for optimizer and scheduler files. Ground truths: an
argument nothing would use is refused by name before anything is written or changed (the folder, the
weights and the optimizer state as they were), and an argument DeepSpeed takes changes what DeepSpeed
does (the ``latest`` file it writes or not, the optimizer state it restores or not).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from hasten import Accelerator, FullyShardedDataParallelPlugin
from hasten.accelerator_state_files import load_accelerator_state, save_accelerator_state
from hasten.exceptions import ConfigurationError


def _setup(**kwargs):
    accelerator = Accelerator(**kwargs)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = DataLoader(torch.ones(6, 4), batch_size=3)  # DeepSpeed's micro batch size comes from it
    model, optimizer, _ = accelerator.prepare(model, optimizer, loader)
    return accelerator, model, optimizer


def _train_step(accelerator, model, optimizer) -> None:
    accelerator.backward(model(torch.ones(3, 4)).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()


def _tensors(state, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a (nested) state dict, by its path: DeepSpeed's optimizer states nest otherwise."""
    if isinstance(state, torch.Tensor):
        return {prefix: state.detach().clone()}
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, (list, tuple)) else ()
    return {k: v for key, value in items for k, v in _tensors(value, f"{prefix}/{key}").items()}


def _state(accelerator, model, optimizer) -> tuple[dict, dict]:
    return _tensors(accelerator.get_state_dict(model)), _tensors(optimizer.state_dict())


def _same(a: tuple[dict, dict], b: tuple[dict, dict]) -> bool:
    return all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


def test_save_state_refuses_an_argument_it_would_drop_before_writing(tmp_path):
    accelerator, model, optimizer = _setup()
    with pytest.raises(ConfigurationError, match=r"save_state\(\) got keyword arguments it does not use: "
                                                 r"bogus_argument\. .*DeepSpeed"):
        accelerator.save_state(tmp_path / "ck", bogus_argument=1)
    with pytest.raises(ConfigurationError, match="bogus_argument"):
        accelerator.save_state(tmp_path / "ck", async_save=True, bogus_argument=1)
    assert list(tmp_path.iterdir()) == []  # no folder, no staging folder


def test_load_state_refuses_arguments_and_load_kwargs_it_would_drop_before_changing_anything(tmp_path):
    accelerator, model, optimizer = _setup()
    _train_step(accelerator, model, optimizer)
    folder = accelerator.save_state(tmp_path / "ck")
    _train_step(accelerator, model, optimizer)
    before = _state(accelerator, model, optimizer)
    refused = [({"bogus_argument": 1}, r"load_state\(\) got keyword arguments it does not use: bogus_argument"),
               ({"assign": True}, "assign"),
               ({"load_kwargs": {"mmap": True}}, r"load_state\(load_kwargs=\.\.\.\) got options .*: mmap"),
               ({"load_kwargs": {"weights_only": False}}, r"weights_only.*add_safe_types")]
    for kwargs, message in refused:
        with pytest.raises(ConfigurationError, match=message):
            accelerator.load_state(folder, **kwargs)
        assert _same(_state(accelerator, model, optimizer), before), kwargs
    # What Accelerate does with them: weights_only=True (hasten's own reading) and strict are honoured.
    accelerator.load_state(folder, load_kwargs={"weights_only": True}, strict=True)
    assert not _same(_state(accelerator, model, optimizer), before)


def test_load_accelerator_state_refuses_options_it_would_drop(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    save_accelerator_state(tmp_path, [model.state_dict()], [], [], [], process_index=0, step=3)
    with pytest.raises(ConfigurationError, match="assign"):
        load_accelerator_state(tmp_path, [model], [], [], [], process_index=0, assign=True)
    with pytest.raises(ConfigurationError, match="mmap"):
        load_accelerator_state(tmp_path, [model], [], [], [], process_index=0, load_kwargs={"mmap": True})
    assert load_accelerator_state(tmp_path, [model], [], [], [], process_index=0, strict=False,
                                  load_kwargs={"weights_only": True}) == {"step": 3}


def test_fsdp_set_mixed_precision_checks_buffer_autocast():
    policies = []
    for buffer_autocast in (False, True):
        plugin = FullyShardedDataParallelPlugin()
        plugin.set_mixed_precision("bf16", buffer_autocast=buffer_autocast)
        policies.append(plugin.mixed_precision_policy)
    assert policies == ["bf16", "bf16"]  # FSDP2 has no buffer dtype: buffers keep the model's, either way
    with pytest.raises(ConfigurationError, match=r"buffer_autocast='yes'"):
        FullyShardedDataParallelPlugin().set_mixed_precision("bf16", buffer_autocast="yes")


def _deepspeed_arguments(root: str) -> tuple[bool, bool, str, bool]:
    from hasten.config.plugins.deepspeed import DeepSpeedPlugin

    accelerator, model, optimizer = _setup(deepspeed_plugin=DeepSpeedPlugin(zero_stage=1))
    _train_step(accelerator, model, optimizer)
    saved = _state(accelerator, model, optimizer)
    without_latest = accelerator.save_state(Path(root) / "a", save_latest=False)
    with_latest = accelerator.save_state(Path(root) / "b")
    try:
        accelerator.save_state(Path(root) / "c", bogus_argument=1)
        refused = ""
    except ConfigurationError as exc:
        refused = str(exc)
    _train_step(accelerator, model, optimizer)
    moved = _state(accelerator, model, optimizer)
    accelerator.load_state(without_latest, load_optimizer_states=False)
    weights, optimizer_state = _state(accelerator, model, optimizer)
    weights_back = _same((weights, {}), (saved[0], {}))

    def moments(state: dict) -> dict:  # Adam's; the fp32 master partition follows the loaded weights
        return {k: v for k, v in state.items() if k.startswith("/base_optimizer_state/")}

    kept, before = moments(optimizer_state), (moments(moved[1]), moments(saved[1]))
    optimizer_kept = bool(kept) and _same(({}, kept), ({}, before[0])) and not _same(({}, kept), ({}, before[1]))
    return ((without_latest / "latest").exists(), (with_latest / "latest").exists(), refused,
            weights_back and optimizer_kept)


@pytest.mark.slow
def test_deepspeed_receives_save_state_and_load_state_arguments_as_in_accelerate(tmp_path):
    from hasten.testing import preload_deepspeed, run_on_ranks

    preload_deepspeed()
    latest_a, latest_b, refused, loaded = run_on_ranks(_deepspeed_arguments, world_size=1, args=(str(tmp_path),),
                                                       timeout=240)[0]
    assert not latest_a and latest_b  # save_latest=False reached engine.save_checkpoint
    assert "bogus_argument" in refused and "client_state" in refused  # names it, and what DeepSpeed takes
    assert loaded  # load_optimizer_states=False: weights restored, optimizer state left as it was
