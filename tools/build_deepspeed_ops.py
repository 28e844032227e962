"""Build DeepSpeed's two CPU extensions that the test suite uses, ahead of the tests (``make test`` runs this
in the background while pip installs the rest).

On a fresh machine DeepSpeed compiles ``cpu_adam`` (ZeRO optimizer offload) and ``deepspeed_shm_comm`` (built
whenever its CPU accelerator starts its communication backend) with ninja on first use: about 120 s and
225 CPU-s on 2 cores. Inside the tests that work lands in the busiest part of the run; during the install
one core is mostly idle. The builds go to torch's extension cache (``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``), where the tests find them; a test that starts while a build is still
running waits for it on torch's lock file. Best effort: any failure is printed and the tests build the
extensions themselves, as before.
"""

from __future__ import annotations

import os
import sys
import time


def _compatible(name: str) -> bool:
    import deepspeed.ops

    return bool(deepspeed.ops.__compatible_ops__.get(name, False))


def main() -> int:
    os.environ["DS_ACCELERATOR"] = "cpu"  # what hasten's import_deepspeed("cpu") selects in the tests
    started = time.monotonic()
    try:
        from deepspeed.accelerator import get_accelerator
    except Exception as exc:  # noqa: BLE001 - best effort: report and leave the build to the tests
        print(f"build_deepspeed_ops: deepspeed unavailable ({exc}); nothing built", flush=True)
        return 0
    for name in ("CPUAdamBuilder", "ShareMemCommBuilder"):
        try:
            builder = get_accelerator().create_op_builder(name)
            if builder is None or not _compatible(builder.NAME):
                continue  # DeepSpeed itself would not build it here either
            builder.load(verbose=False)
            print(f"build_deepspeed_ops: {name} ready after {time.monotonic() - started:.1f} s", flush=True)
        except Exception as exc:  # noqa: BLE001
            print(f"build_deepspeed_ops: {name} failed ({type(exc).__name__}: {exc}); the tests will build it",
                  file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
