"""Apply checked states to live objects as one unit: a failure puts back what was already restored."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import torch

from hasten.checkpointing.rng import CheckpointError


class Transaction:
    """``with Transaction(folder) as tx: tx.apply(name, obj, state) ...``; on error every applied object
    gets its previous ``state_dict`` back and a CheckpointError names the object that failed.

    Optimizers are snapshotted without copying tensors: ``load_state_dict`` builds new state tensors
    and leaves the old ones as they were, so keeping references is enough (no extra memory).
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._undo: list[tuple[Any, Any]] = []
        self._undone = False

    def __enter__(self) -> Transaction:
        return self

    def apply(self, what: str, obj: Any, state: Any) -> None:
        """``obj.load_state_dict(state)``, remembering how to undo it."""
        current = obj.state_dict()
        inner = getattr(obj, "optimizer", obj)
        previous = current if isinstance(inner, torch.optim.Optimizer) else _copy_or_same(current)
        self._undo.append((obj, previous))
        self.run(what, lambda: obj.load_state_dict(state))

    def on_undo(self, restore: Callable[[], Any]) -> None:
        """Run ``restore()`` (besides putting back the applied objects) if the transaction is undone."""
        self._undo.append((_Callback(restore), None))

    def undo(self) -> None:
        """Put every applied object back, newest first (once; best effort: the original error matters)."""
        if self._undone:
            return
        self._undone = True
        for obj, previous in reversed(self._undo):
            try:
                obj.load_state_dict(previous)
            except Exception:  # noqa: BLE001, S112 - best effort; the original error is what matters
                continue

    def run(self, what: str, action: Callable[[], Any]) -> None:
        """Run ``action``; an exception becomes a CheckpointError naming ``what`` and the folder."""
        try:
            action()
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"load_state: {what} could not be restored from {self.folder}: {exc!r}. The states "
                                  "restored before it were put back; fix the object or load another checkpoint.") from exc

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> Literal[False]:
        if exc_type is not None:
            self.undo()
        return False


class _Callback:
    """An undo step that is a plain callable (``load_state_dict`` calls it, ignoring the argument)."""

    def __init__(self, restore: Callable[[], Any]) -> None:
        self._restore = restore

    def load_state_dict(self, _state: Any) -> None:
        self._restore()


def _copy_or_same(state: Any) -> Any:
    """A deep copy of ``state``, or ``state`` itself when it cannot be copied (locks, handles)."""
    try:
        return copy.deepcopy(state)
    except Exception:  # noqa: BLE001 - the undo is best effort; the load itself must not fail here
        return state


__all__ = ["Transaction"]
