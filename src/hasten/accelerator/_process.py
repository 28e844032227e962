"""Process control on the Accelerator: thin delegation to the shared ``PartialState``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from hasten.accelerator._base import AcceleratorBase
from hasten.runtime.preemption import PREEMPTION as _PREEMPTION
from hasten.state import AcceleratorState


class ProcessControlMixin(AcceleratorBase):
    """Who am I, and run this only here: every method delegates to ``self.state``."""

    state: AcceleratorState

    @property
    def device(self) -> torch.device:
        """The device this process computes on."""
        return self.state.device

    @property
    def num_processes(self) -> int:
        return self.state.num_processes

    @property
    def process_index(self) -> int:
        return self.state.process_index

    @property
    def local_process_index(self) -> int:
        return self.state.local_process_index

    @property
    def is_main_process(self) -> bool:
        return self.state.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self.state.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        return self.state.is_last_process

    @property
    def use_distributed(self) -> bool:
        return self.state.use_distributed

    def wait_for_everyone(self) -> None:
        """Barrier across all processes (a no-op with one). Every process must call it."""
        _PREEMPTION.before_call("wait_for_everyone")  # a preemption boundary in loops without steps
        self.state.wait_for_everyone()

    @contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Run the block on the main process first, then on the others."""
        with self.state.main_process_first():
            yield

    @contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """Run the block on each machine's first process first."""
        with self.state.local_main_process_first():
            yield

    @contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """Each process gets a contiguous share of ``inputs`` (see ``PartialState.split_between_processes``)."""
        with self.state.split_between_processes(inputs, apply_padding=apply_padding) as share:
            yield share

    def on_main_process(self, function: Callable[..., Any] | None = None) -> Callable[..., Any]:
        """Decorator: run only on the main process."""
        return self.state.on_main_process(function)

    def on_local_main_process(self, function: Callable[..., Any] | None = None) -> Callable[..., Any]:
        """Decorator: run only on each machine's first process."""
        return self.state.on_local_main_process(function)

    def on_last_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: run only on the last process."""
        return self.state.on_last_process(function)

    def on_process(self, function: Callable[..., Any] | None = None, process_index: int | None = None) -> Callable[..., Any]:
        """Decorator: run only on the process with this global index."""
        return self.state.on_process(function, process_index=process_index)

    def on_local_process(self, function: Callable[..., Any] | None = None,
                         local_process_index: int | None = None) -> Callable[..., Any]:
        """Decorator: run only on the process with this local index."""
        return self.state.on_local_process(function, local_process_index=local_process_index)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` once per machine (on the local main process)."""
        self.state.print(*args, **kwargs)
