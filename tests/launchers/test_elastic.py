"""Elastic restart: a worker group restarted by `hasten launch --max_restarts` resumes from its newest
checkpoint and ends with exactly the weights of an uninterrupted run."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

SCRIPT = textwrap.dedent("""
    import os, sys
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    from hasten import Accelerator, ProjectConfiguration
    from hasten.checkpointing import newest_checkpoint
    from hasten.utils import set_seed

    project, output, crash_marker = sys.argv[1], sys.argv[2], sys.argv[3]

    class Progress:
        def __init__(self): self.epoch = 0
        def state_dict(self): return {"epoch": self.epoch}
        def load_state_dict(self, state): self.epoch = state["epoch"]

    accelerator = Accelerator(project_config=ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True))
    set_seed(5)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    x = torch.randn(40, 4, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if newest_checkpoint(project) is not None:
        accelerator.load_state()          # the restarted group continues where the last save left off
        accelerator.print(f"resumed from {newest_checkpoint(project).name}")
    step = 0
    while progress.epoch < 3:
        for xb, yb in loader:
            accelerator.backward(nn.functional.mse_loss(model(xb), yb))
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % 2 == 0:
                accelerator.save_state()
                if accelerator.save_iteration == 2 and crash_marker != "-" and not os.path.exists(crash_marker):
                    if accelerator.process_index == 1:
                        open(crash_marker, "w").close()
                        raise RuntimeError("injected crash after the 2nd checkpoint")
        progress.epoch += 1
    if accelerator.is_main_process:
        torch.save([p.detach() for p in accelerator.unwrap_model(model).parameters()], output)
    accelerator.end_training()
""")


@pytest.mark.launch
def test_restart_resumes_from_newest_checkpoint(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    hasten = [sys.executable, "-m", "hasten.commands.main", "launch", "--cpu", "--num_processes", "2"]
    marker = tmp_path / "crashed"
    crashed = subprocess.run(hasten + ["--max_restarts", "1", str(script), str(tmp_path / "a"), str(tmp_path / "a.pt"),
                                       str(marker)], env=env, capture_output=True, text=True, timeout=300)
    assert crashed.returncode == 0, crashed.stdout + crashed.stderr
    assert marker.exists() and "resumed from checkpoint_1" in crashed.stdout
    clean = subprocess.run(hasten + [str(script), str(tmp_path / "b"), str(tmp_path / "b.pt"), "-"], env=env,
                           capture_output=True, text=True, timeout=300)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    for a, b in zip(torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")):
        assert torch.equal(a, b)
