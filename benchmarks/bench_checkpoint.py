"""What hasten's checkpoint guarantees cost: save_state / load_state of a ~1.6 GB model, one process.

Rows (wall-clock seconds, one run each, files on the same disk):
  * hasten save_state: safetensors write + fsync of every file and folder + CRC-32 of every file
    (manifest) + atomic publication; the checksum+fsync part is also timed on its own;
  * torch.save and safetensors save_file of the same tensors (no fsync, no checksum: what a plain
    script does; their data may still be in the page cache when they return);
  * hasten load_state with and without checksum verification (``verify_checksums=False``);
  * torch.load(weights_only=True) and safetensors load_file of the same tensors.
The loads run twice each, alternating, and the second run is reported (the page cache then holds
what it can for both). The checksum's cost is then mostly the CPU cost of CRC-32 over the bytes
(zlib over a memory map, ~2.4 GB/s on an idle core here) plus whatever the cache could not hold.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_checkpoint.py --gb 1.6 --dir /tmp/bench_ckpt
"""

from __future__ import annotations

import argparse
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hasten import Accelerator
from hasten.checkpointing import manifest, sinks


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def build(gb: float, width: int = 4096) -> nn.Module:
    layers = max(1, round(gb * 1e9 / (width * width * 4)))
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.01, 0.01)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.6)
    parser.add_argument("--dir", default="/tmp/bench_ckpt")
    parser.add_argument("--quick", action="store_true", help="a 0.1 GB model: checks the script works (not a measurement)")
    args = parser.parse_args()
    if args.quick:
        args.gb = 0.1
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    torch.set_num_threads(1)
    model = build(args.gb)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    accelerator = Accelerator()
    model = accelerator.prepare(model)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}

    phase: dict[str, float] = {"manifest": 0.0}
    real_write = manifest.write_manifest

    def write_manifest_timed(folder: Path, num_processes: int, sealed: Any = None) -> Any:
        took, out = timed(lambda: real_write(folder, num_processes, sealed))
        phase["manifest"] += took
        return out

    # Each file is checksummed as it is written and its fsync waited for before publication
    # (hasten.checkpointing.sinks.SealedSink): that time belongs to the same row.
    for name in ("seal", "finish"):
        real = getattr(sinks.SealedSink, name)

        def timed_method(self: Any, *a: Any, _real: Any = real) -> Any:
            took, out = timed(lambda: _real(self, *a))
            phase["manifest"] += took
            return out

        setattr(sinks.SealedSink, name, timed_method)

    manifest.write_manifest = write_manifest_timed  # type: ignore[assignment]
    import hasten.checkpointing.publication as publication

    publication.write_manifest = write_manifest_timed  # type: ignore[assignment]

    rows: list[tuple[str, float]] = []
    took, _ = timed(lambda: accelerator.save_state(root / "hasten"))
    rows.append(("hasten save_state (fsync + CRC-32 manifest + publish)", took))
    rows.append(("  of which: checksum + fsync of the files, waiting for them, manifest", phase["manifest"]))
    only_crc, _ = timed(lambda: [manifest.file_checksum(root / "hasten" / name)
                                 for name in manifest.list_files(root / "hasten")])
    rows.append(("  CRC-32 alone over the saved files (page cache)", only_crc))
    from safetensors.torch import load_file, save_file

    took, _ = timed(lambda: torch.save(state, root / "plain.pt"))
    rows.append(("torch.save (no fsync)", took))
    took, _ = timed(lambda: save_file(state, str(root / "plain.safetensors")))
    rows.append(("safetensors save_file (no fsync)", took))
    # Each load twice, alternating, and the second one reported: the first pass may read from disk
    # (a small page cache), the second finds what the first left in it, the same for both.
    for _ in range(2):
        plain, _ = timed(lambda: accelerator.load_state(root / "hasten", verify_checksums=False))
        verified, _ = timed(lambda: accelerator.load_state(root / "hasten"))
    rows.append(("hasten load_state, verify_checksums=False", plain))
    rows.append(("hasten load_state, checksums verified", verified))
    took, _ = timed(lambda: torch.load(root / "plain.pt", weights_only=True))
    rows.append(("torch.load(weights_only=True)", took))
    took, _ = timed(lambda: load_file(str(root / "plain.safetensors")))
    rows.append(("safetensors load_file", took))

    print(f"model: {size / 1e9:.2f} GB fp32 ({len(state)} tensors), torch {torch.__version__}")
    for name, seconds in rows:
        print(f"{name:<58} {seconds:7.2f} s  ({size / 1e9 / seconds:5.2f} GB/s)")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
