"""Accelerate's ``accelerate.utils.tqdm`` path; the bar itself lives in :mod:`hasten.logging` (it reads the rank).

Part of the ``hasten.utils`` facade: it resolves the function lazily, so this bottom-layer package does
not import the state layer at import time.
"""

from __future__ import annotations

from typing import Any

from hasten._lazy import accelerate_path_getattr


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """``hasten.logging.tqdm``: a bar on each machine's first process only unless ``main_process_only=False``."""
    from hasten.logging import tqdm as rank_aware_tqdm

    return rank_aware_tqdm(*args, main_process_only=main_process_only, **kwargs)

# Names Accelerate's module at this path shows but defines elsewhere (hasten/_accelerate_shown.py).
__getattr__ = accelerate_path_getattr(__name__, globals())
