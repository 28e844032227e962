"""Training scripts that several launch tests write to a file and start under ``hasten launch``."""

import textwrap

#: Trains 3 epochs with a checkpoint every 2 steps; argv: project folder, output weights file, crash marker
#: ("-": never crash). Process 1 crashes once after the 2nd checkpoint (creating the marker), so a group
#: restarted by ``--max_restarts`` resumes from the newest checkpoint and must end with the weights of an
#: uninterrupted run.
RESUMING_TRAINER = textwrap.dedent("""
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
