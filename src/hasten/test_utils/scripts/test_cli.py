"""Report the accelerators this process sees (Accelerate's ``test_cli.py`` name): a smoke test that a
launched script starts. Run with ``hasten launch hasten/test_utils/scripts/test_cli.py``."""

from __future__ import annotations

import torch

from hasten.utils import is_xpu_available


def main() -> None:
    kind, count = "GPU", 0
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
    elif is_xpu_available():
        kind, count = "XPU", torch.xpu.device_count()
    print(f"Successfully ran on {count} {kind}s")


if __name__ == "__main__":
    main()
