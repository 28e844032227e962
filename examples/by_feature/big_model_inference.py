"""Big-model inference: build a model without memory, load its checkpoint piece by piece, offload what does not fit.

1. ``init_empty_weights()`` builds the model on the ``meta`` device: no memory is used, whatever its size.
2. ``load_checkpoint_and_dispatch(model, folder, device_map="auto", max_memory=...)`` decides where each
   block goes (GPUs first, then CPU memory, then disk, within ``max_memory``), loads the checkpoint
   shard by shard into place, writes the disk-mapped weights to ``offload_folder``, and adds hooks that
   bring each offloaded block's weights to the execution device just for its forward.
3. The dispatched model is then called as usual.

Here a small residual MLP stands in for the big model; ``--max_cpu_memory`` is set so low that part of
it must go to disk. The script checks that the dispatched model computes exactly what the ordinary
one does. With several processes each one loads the model and answers its own share of the inputs.

    python examples/by_feature/big_model_inference.py --max_cpu_memory 3MB
    hasten launch --num_processes 2 examples/by_feature/big_model_inference.py
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

from hasten import Accelerator, init_empty_weights, load_checkpoint_and_dispatch
from hasten.utils import broadcast_object_list


class Block(nn.Module):
    """One residual block: the unit that is never split across devices (``no_split_module_classes``)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class BigNet(nn.Module):
    def __init__(self, width: int = 256, depth: int = 8) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(width) for _ in range(depth)))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default=None,
                        help="Load the weights in this precision (no: float32).")
    parser.add_argument("--cpu", action="store_true", help="Run on the CPU even if a GPU is available.")
    parser.add_argument("--max_cpu_memory", default="3MB", help="CPU memory the weights may use; the rest goes to disk.")
    parser.add_argument("--work_dir", default=None, help="Where the checkpoint and offloaded weights go (default: a temp dir).")
    parser.add_argument("--num_inputs", type=int, default=16)
    args = parser.parse_args()

    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision, torch.float32)
    work_dir = args.work_dir
    if work_dir is None:  # process 0 makes a temporary folder and tells the others its name
        work_dir = broadcast_object_list([tempfile.mkdtemp(prefix="big_model_") if accelerator.is_main_process
                                          else None])[0]

    # Stand-in for a downloaded model: random weights saved as a sharded safetensors checkpoint.
    torch.manual_seed(0)
    reference = BigNet().to(dtype).eval()
    checkpoint = os.path.join(work_dir, "checkpoint")
    accelerator.save_model(reference, checkpoint, max_shard_size="1MB")  # main process writes; all wait

    # 1. No memory used: parameters live on the meta device.
    with init_empty_weights():
        model = BigNet()
    # 2. Load and place block by block; each process offloads into its own folder.
    model = load_checkpoint_and_dispatch(
        model, checkpoint, device_map="auto", max_memory={"cpu": args.max_cpu_memory},
        no_split_module_classes=["Block"], dtype=dtype,
        offload_folder=os.path.join(work_dir, f"offload_{accelerator.process_index}"))
    placement = sorted({str(device) for device in model.hf_device_map.values()})
    accelerator.print(f"device map: {len(model.hf_device_map)} parts on {placement}")

    # 3. Inference as usual; each process answers its share of the inputs.
    inputs = torch.randn(args.num_inputs, 256, generator=torch.Generator().manual_seed(1)).to(dtype)
    with accelerator.split_between_processes(inputs) as my_inputs, torch.no_grad():
        outputs, expected = model(my_inputs), reference(my_inputs)
    difference = accelerator.gather_for_metrics((outputs - expected).abs().max().reshape(1)).max().item()
    accelerator.print(f"{args.num_inputs} inputs on {accelerator.num_processes} process(es): "
                      f"max |dispatched - ordinary| = {difference:.3g}")
    accelerator.wait_for_everyone()
    if args.work_dir is None and accelerator.is_main_process:
        shutil.rmtree(work_dir)
    accelerator.end_training()


if __name__ == "__main__":
    main()
