"""A save that fails on one process fails on every process, with the same message (issue 34, item 2).

Synchronous and asynchronous saves share one publication sequence: write, seal, publish, prune, the
processes agreeing after each step. Ground truths: every process's error message (the same text,
naming the failing process and the cause), the weights of the checkpoint that must be loadable after
the failure (the previous one when nothing was published, the new one when it was), and that the run
goes on (a further collective, the load, succeeds on every process).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hasten import ProjectConfiguration
from hasten.checkpointing import SAVE_STAGE_HOOKS, CheckpointError
from hasten.testing import run_on_ranks
from helpers.checkpoints import prepared_model_optimizer


def _train_step(accelerator, model, optimizer) -> None:
    accelerator.backward(model(torch.ones(3, 4)).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()


def _weights(accelerator, model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}


#: Where the failure is injected: (on which process, how), and whether the new checkpoint is published.
FAILURES = {
    "pre_hook": (1, False),       # a save pre-hook raises on process 1 only (the reported hang)
    "sealing": (1, False),        # process 1's files cannot be made durable
    "publishing": (0, True),      # the main process fails once the new folder is in place
    "pruning": (0, True),         # rotation fails on the main process after publication
}


def _fail_one_save(root: str, where: str, async_save: bool) -> tuple[str, bool]:
    """Save, train, save again with ``where`` failing on one process; the error, and whether the
    checkpoint loaded afterwards holds the expected weights."""
    failing_rank, published = FAILURES[where]
    # Rotation needs automatic naming; the other cases replace one folder (publishing swaps it in).
    rotating = where == "pruning"
    config = ProjectConfiguration(project_dir=root, automatic_checkpoint_naming=rotating, total_limit=1)
    folder = None if rotating else Path(root) / "ck"
    accelerator, model, optimizer = prepared_model_optimizer(project_config=config)
    _train_step(accelerator, model, optimizer)
    accelerator.save_state(folder)
    previous = _weights(accelerator, model)
    _train_step(accelerator, model, optimizer)
    new = _weights(accelerator, model)
    mine = accelerator.process_index == failing_rank

    def hook(models, weights, folder):
        if mine:
            raise ValueError("the pre-hook refuses")

    def stage(name: str, path: Path) -> None:
        if mine and (where, name) in (("sealing", "before_publish"), ("publishing", "exchanged"),
                                      ("pruning", "pruning")):
            raise OSError(5, "Input/output error", str(path))

    if where == "pre_hook":
        accelerator.register_save_state_pre_hook(hook)
    SAVE_STAGE_HOOKS.append(stage)
    try:
        with pytest.raises(CheckpointError) as caught:
            accelerator.save_state(folder, async_save=async_save)
            accelerator.wait_for_checkpoint()
    finally:
        SAVE_STAGE_HOOKS.clear()
    _train_step(accelerator, model, optimizer)  # the run goes on; the load puts the checkpoint back
    accelerator.load_state(folder)  # with automatic naming: the newest complete checkpoint
    expected = new if published else previous
    loaded = _weights(accelerator, model)
    return str(caught.value), all(torch.equal(loaded[k], expected[k]) for k in expected)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("where", list(FAILURES))
def test_a_save_failing_on_one_process_is_raised_on_every_process(tmp_path, where, async_save):
    # A process left waiting would time out in its next collective after pg_timeout and raise
    # another error (or none): the same message on both processes rules that out.
    results = run_on_ranks(_fail_one_save, world_size=2, args=(str(tmp_path), where, async_save), pg_timeout=30,
                           timeout=100)
    (message0, loaded0), (message1, loaded1) = results
    assert message0 == message1, results
    failing_rank, published = FAILURES[where]
    assert f"process {failing_rank}: " in message0
    assert ("the pre-hook refuses" if where == "pre_hook" else "Input/output error") in message0
    if not published:
        assert "nothing was published; the previous checkpoint is intact" in message0
    assert loaded0 and loaded1
