"""``tqdm`` that draws one progress bar per machine (on its first process) instead of one per process."""

from __future__ import annotations

from typing import Any


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """A ``tqdm.auto.tqdm`` bar, shown on the local main process only unless ``main_process_only=False``.

    Arguments are ``tqdm``'s. On the other processes the bar is created with ``disable=True``, so it
    still iterates (and ``update``/``close`` work) but draws nothing.

    Raises:
        ValueError: a bool was passed as the first argument (the old positional ``main_process_only``
            of Accelerate); pass ``main_process_only=...`` by keyword.

    Example:
        >>> for batch in tqdm(dataloader, desc="train"):
        ...     ...
    """
    if args and isinstance(args[0], bool):
        raise ValueError("tqdm(True/False, ...) is not supported: pass `main_process_only=` as a keyword "
                         "argument and the iterable first, e.g. tqdm(loader, main_process_only=True).")
    from tqdm.auto import tqdm as _tqdm

    disable = kwargs.pop("disable", False)
    if main_process_only and not disable:
        from hasten.state import PartialState

        disable = PartialState().local_process_index != 0
    return _tqdm(*args, **kwargs, disable=disable)
