"""Build DeepSpeed's two CPU extensions that the test suite uses, ahead of the tests (``make test`` runs this
in the background while pip installs the rest).

On a fresh machine DeepSpeed compiles ``cpu_adam`` (ZeRO optimizer offload) and ``deepspeed_shm_comm`` (built
whenever its CPU accelerator starts its communication backend) with ninja on first use: about 120 s and
225 CPU-s on 2 cores. Inside the tests that work lands in the busiest part of the run; during the install
one core is mostly idle. The builds go to torch's extension cache (``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``), where the tests find them; a test that starts while a build is still
running waits for it on torch's lock file. Best effort: any failure is printed and the tests build the
extensions themselves, as before.

``--marker PATH`` writes PATH once every extension is ready (or is one DeepSpeed would not build here), so
``make test`` knows the build is done for this venv; ``make deepspeed-ops`` runs this script in the foreground
before the tests, where it waits on torch's lock for a build still running in the background, then loads it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _compatible(name: str) -> bool:
    import deepspeed.ops

    return bool(deepspeed.ops.__compatible_ops__.get(name, False))


def _warn_about_stale_locks(max_age_s: float = 600.0) -> None:
    """Name any lock in torch's extension cache older than ``max_age_s``.

    torch's build lock is a bare file made with ``O_EXCL``: a build that was killed leaves it behind, and every
    later load of that extension waits on it forever without a word. A lock that old is almost always such a
    leftover; saying so turns a silent hang of ``make test`` into a line with the fix.
    """
    import glob

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "torch_extensions")
    for lock in glob.glob(os.path.join(root, "*", "*", "lock")) + glob.glob(os.path.join(root, "*", "lock")):
        age = time.time() - os.path.getmtime(lock)
        if age > max_age_s:
            print(f"build_deepspeed_ops: {lock} is {age / 60:.0f} minutes old; a build that was killed leaves it, "
                  f"and torch then waits on it forever: if no compiler is running, delete it", file=sys.stderr,
                  flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--marker", help="file written once every extension is ready")
    args = parser.parse_args(argv)
    os.environ["DS_ACCELERATOR"] = "cpu"  # what hasten's import_deepspeed("cpu") selects in the tests
    started = time.monotonic()
    try:
        from deepspeed.accelerator import get_accelerator
    except Exception as exc:  # noqa: BLE001 - best effort: report and leave the build to the tests
        print(f"build_deepspeed_ops: deepspeed unavailable ({exc}); nothing built", flush=True)
        return 0
    _warn_about_stale_locks()
    all_ready = True
    for name in ("CPUAdamBuilder", "ShareMemCommBuilder"):
        try:
            builder = get_accelerator().create_op_builder(name)
            if builder is None or not _compatible(builder.NAME):
                continue  # DeepSpeed itself would not build it here either
            builder.load(verbose=False)
            print(f"build_deepspeed_ops: {name} ready after {time.monotonic() - started:.1f} s", flush=True)
        except Exception as exc:  # noqa: BLE001
            all_ready = False
            print(f"build_deepspeed_ops: {name} failed ({type(exc).__name__}: {exc}); the tests will build it",
                  file=sys.stderr, flush=True)
    if all_ready and args.marker:
        with open(args.marker, "w") as marker:
            marker.write(f"built in {time.monotonic() - started:.1f} s\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
