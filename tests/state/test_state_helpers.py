"""The one "which process writes a shared file" rule (``state_helpers.writes_shared_files``), as ``save``,
``save_custom_state`` and ``Accelerator.save`` all apply it."""

import os

import pytest
import torch


@pytest.mark.world_size(2)
def test_only_the_main_process_writes_and_each_machine_once_with_save_on_each_node(tmp_path):
    import torch.distributed as dist

    from hasten import Accelerator
    from hasten.state_helpers import writes_shared_files
    from hasten.utils import ProjectConfiguration, save, save_custom_state

    rank = dist.get_rank()
    assert writes_shared_files() == (rank == 0)
    # one machine: its first process is rank 0 (LOCAL_RANK == RANK under the harness)
    assert writes_shared_files(save_on_each_node=True) == (int(os.environ["LOCAL_RANK"]) == 0)

    class Counter:
        def state_dict(self):
            return {"rank": rank}

    save({"rank": rank}, tmp_path / "plain.pt")
    save_custom_state(Counter(), tmp_path, index=0)
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(save_on_each_node=True))
    accelerator.save({"rank": rank}, tmp_path / "facade.pt")
    accelerator.wait_for_everyone()
    for name in ("plain.pt", "custom_checkpoint_0.pkl", "facade.pt"):
        assert torch.load(tmp_path / name, weights_only=True) == {"rank": 0}, name
