"""Process state shared by every object in a process: ``PartialState``, ``AcceleratorState``, ``GradientState``.

Like Accelerate, each class is a "Borg": all instances share one dictionary, so a second
``PartialState()`` sees the state the first one set up. Tests (and notebooks that want a fresh start)
call :func:`reset_state`. With peers (torchrun, MPI, SLURM, ...) ``PartialState`` starts the process
group through :mod:`hasten.runtime.process_group`, which owns its lifetime.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from functools import partial
from typing import Any, Protocol

import torch
import torch.distributed as dist

from hasten._lazy import accelerate_path_getattr
from hasten.base.dataclasses import DistributedType, GradientAccumulationPlugin
from hasten.base.environment import is_env_set, parse_flag_from_env
from hasten.base.split import split_inputs
from hasten.config import env as hasten_env
from hasten.devices import Device, select_device
from hasten.environments import (
    ClusterEnvironment,
    ProcessInfo,
    current_process_info,
    export_torch_env,
)
from hasten.ops.collectives import barrier
from hasten.runtime import process_group
from hasten.runtime.watchdog import DEFAULT_BOUND, process_group_timeout

#: How long a rank may wait in one collective before the watchdog reports every rank and stops the run.
DEFAULT_TIMEOUT = DEFAULT_BOUND
#: Debug mode names a rank missing from a collective within this time at most.
DEBUG_MISSING_RANK_BOUND = timedelta(seconds=60)

_STATE_ATTRIBUTES = ("device", "distributed_type", "num_processes", "process_index", "local_process_index",
                     "backend", "debug")


class ThreadLocalSharedDict(threading.local):
    """A dictionary shared by the objects of one thread (Accelerate uses it for per-thread XLA state)."""

    def __init__(self, thread_local: bool = False) -> None:
        self._storage: dict[str, Any] = {}

    def __get__(self, obj: Any, objtype: Any = None) -> dict[str, Any]:
        return self._storage

    def __set__(self, obj: Any, value: dict[str, Any]) -> None:
        self._storage = value


class _RunStrategy(Protocol):
    """What the state asks of the Accelerator's strategy (the strategy layer is below; no import needed).
    Strategies that own a plugin also answer ``fsdp_plugin``/``deepspeed_plugin``."""

    distributed_type: Any

    def trigger_sync_in_backward(self, model: Any) -> Any: ...


def do_nothing(*args: Any, **kwargs: Any) -> None:
    """Accept anything, do nothing (the function ``on_process`` decorators return on the other ranks)."""
    return None


_do_nothing = do_nothing


def is_initialized() -> bool:
    """Whether an ``Accelerator`` set up the shared ``AcceleratorState`` in this process."""
    return AcceleratorState._shared_state != {}


class _Borg:
    """Pickling a state object gives, on unpickling, an object that joins the unpickling process's state."""

    _shared_state: dict[str, Any]

    def __reduce__(self) -> tuple[Any, ...]:
        return (_attach, (type(self),))


def _attach(cls: type[_Borg]) -> _Borg:
    obj = cls.__new__(cls)
    obj.__dict__ = cls._shared_state
    return obj


class _ProcessQueries(_Borg):
    """Rank queries and process control that ``PartialState`` and ``AcceleratorState`` (as in Accelerate) both
    answer; ``AcceleratorState`` reads the four attributes below from its ``PartialState`` (``__getattr__``)."""

    distributed_type: DistributedType
    num_processes: int
    process_index: int
    local_process_index: int

    @property
    def use_distributed(self) -> bool:
        """True when more than one process takes part."""
        return self.distributed_type != DistributedType.NO and self.num_processes > 1

    @property
    def is_main_process(self) -> bool:
        """True on the process with global rank 0."""
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        """True on the first process of each machine."""
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        """True on the process with the highest global rank."""
        return self.process_index == self.num_processes - 1

    # --------------------------------------------------------------------------------- process control
    def wait_for_everyone(self) -> None:
        """Block until every process reaches this call (a no-op with one process)."""
        barrier()

    @contextmanager
    def _goes_first(self, is_main: bool) -> Iterator[None]:
        if not is_main:
            self.wait_for_everyone()
        yield
        if is_main:
            self.wait_for_everyone()

    @contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Run the block on the main process first, then on the others (e.g. to download or cache once)."""
        with self._goes_first(self.is_main_process):
            yield

    @contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """Like :meth:`main_process_first`, per machine."""
        with self._goes_first(self.is_local_main_process):
            yield

    @contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """Give each process its contiguous share of ``inputs`` (list, tuple, tensor or dict of those).

        The first ``len % num_processes`` processes get one extra item. With ``apply_padding`` every share
        has the same length, the short ones repeating their last item, so results can be gathered.

        Example:
            >>> with PartialState().split_between_processes(["a", "b", "c"]) as part:
            ...     print(part)  # 2 processes: ['a', 'b'] on rank 0, ['c'] on rank 1

        Raises:
            TypeError: ``inputs`` is of another type.
            ValueError: a dict whose values have different lengths.
        """
        yield split_inputs(inputs, self.num_processes, self.process_index, apply_padding)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the local main process only."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    def destroy_process_group(self, group: Any = None) -> None:
        """Tear down the process group (idempotent; also after ``_reset_state()``). hasten also does this at
        exit for groups it started."""
        if group is None and PartialState._shared_state.get("fork_launched", False):
            return
        process_group.end_group(group=group)


class PartialState(_ProcessQueries):
    """Where this process sits and what it computes on; starts the process group when there are peers.

    Args:
        cpu: use the CPU even if an accelerator is available.
        **kwargs: passed to ``torch.distributed.init_process_group`` (``backend``, ``timeout``, ...).

    Example:
        >>> state = PartialState()
        >>> state.num_processes, state.process_index, state.device
        (1, 0, device(type='cpu'))
    """

    _shared_state: dict[str, Any] = {}

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        self.__dict__ = self._shared_state
        if self.initialized:
            return
        launch = hasten_env.worker_launch_dict()  # hasten launch's configuration, else the configuration file
        # Accelerate honours ACCELERATE_USE_CPU here too (its launcher and the test harness set it).
        cpu = cpu or bool(launch.get("use_cpu", False)) or parse_flag_from_env("ACCELERATE_USE_CPU")
        environment, info = current_process_info()
        device_kind = select_device(cpu=cpu)
        self._setup(environment, info, device_kind, cpu, kwargs)

    def _setup(self, environment: ClusterEnvironment, info: ProcessInfo, device_kind: Device, cpu: bool,
               kwargs: dict[str, Any]) -> None:
        # The watchdog's bound; the process group's own timeout is a little longer (torch's error as backstop).
        timeout = kwargs.pop("timeout", None) or hasten_env.collective_timeout() or DEFAULT_TIMEOUT
        backend = kwargs.pop("backend", None) or device_kind.dist_backend
        owns_group = False
        if dist.is_available() and dist.is_initialized():
            # Someone (a test harness, notebook_launcher, the user) already started the group: adopt it.
            rank, world = dist.get_rank(), dist.get_world_size()
            local_rank = info.local_rank if info.world_size == world and info.rank == rank else rank
            backend = dist.get_backend()
        elif info.world_size > 1:
            export_torch_env(info)
            _limit_cpu_threads(device_kind, info)
            if device_kind.name != "cpu":
                device_kind.setup(device_kind.torch_device(info.local_rank))
            process_group.start_group(backend=backend, rank=info.rank, world_size=info.world_size,
                                      timeout=process_group_timeout(timeout), **kwargs)
            rank, world, local_rank, owns_group = info.rank, info.world_size, info.local_rank, True
        else:
            rank, world, local_rank = 0, 1, 0
            backend = None
        forced = hasten_env.accelerate_torch_device()  # Accelerate's override, index included ("cpu:64")
        device = torch.device(forced) if forced else device_kind.torch_device(local_rank)
        device_kind.setup(device)
        self._cpu = cpu
        self.environment = environment
        self.device_kind = device_kind
        self.device = device
        self.backend = backend
        self.num_processes = world
        self.process_index = rank
        self.local_process_index = local_rank
        self.num_local_processes = info.local_world_size if info.world_size == world else world
        self.distributed_type = DistributedType(device_kind.distributed_type) if world > 1 else DistributedType.NO
        self.timeout = timeout
        self._debug = False
        self.debug = hasten_env.debug_mode()
        self.fork_launched = False
        self._owns_group = owns_group
        if world > 1:
            # In debug mode the monitored barrier names a missing rank first; the watchdog comes after it.
            bound = timeout + (min(timeout, DEBUG_MISSING_RANK_BOUND) if self.debug else timedelta())
            process_group.watch_run(bound, owned=owns_group)

    # ----------------------------------------------------------------------------------------- properties
    @property
    def initialized(self) -> bool:
        """True once a ``PartialState`` was created in this process (and not reset)."""
        return self._shared_state != {}

    @property
    def debug(self) -> bool:
        """Debug mode: collectives first check that every rank calls the same one with matching shapes.

        Setting it (on every rank, like ``HASTEN_DEBUG_MODE=1``) turns the checks on or off; a mismatch
        raises ``DistributedOperationError`` (Accelerate's ``DistributedOperationException``).
        """
        return bool(self.__dict__.get("_debug", False))

    @debug.setter
    def debug(self, value: bool) -> None:
        value = bool(value)
        if value == self.__dict__.get("_debug", False):
            return
        self.__dict__["_debug"] = value
        process_group.set_debug_checks(value, timeout=self.timeout, bound=min(self.timeout, DEBUG_MISSING_RANK_BOUND))

    @property
    def default_device(self) -> torch.device:
        """The device a process would use when nothing is forced."""
        return select_device().torch_device(0)

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: explain a reset state instead of a bare AttributeError.
        if name in _STATE_ATTRIBUTES:
            raise AttributeError(
                f"`PartialState` object has no attribute `{name}`. This happens if `PartialState._reset_state()` "
                "was called and an `Accelerator` or `PartialState` was not reinitialized.")
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __repr__(self) -> str:
        return (f"Distributed environment: {self.distributed_type}{('  Backend: ' + self.backend) if self.backend else ''}\n"
                f"Num processes: {self.num_processes}\nProcess index: {self.process_index}\n"
                f"Local process index: {self.local_process_index}\nDevice: {self.device}\n")

    def _require_init(self) -> None:
        if not self.initialized:
            raise ValueError("The `PartialState` or `Accelerator` must be initialized before calling this function.")

    def on_main_process(self, function: Callable[..., Any] | None = None) -> Callable[..., Any]:
        """Decorator: run ``function`` only on the main process (everywhere when not distributed)."""
        self._require_init()
        if function is None:
            return self.on_main_process
        return function if self.is_main_process or not self.use_distributed else _do_nothing

    def on_local_main_process(self, function: Callable[..., Any] | None = None) -> Callable[..., Any]:
        """Decorator: run ``function`` only on the first process of each machine."""
        self._require_init()
        if function is None:
            return self.on_local_main_process
        return function if self.is_local_main_process or not self.use_distributed else _do_nothing

    def on_last_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: run ``function`` only on the last process."""
        self._require_init()
        return function if self.is_last_process or not self.use_distributed else _do_nothing

    def on_process(self, function: Callable[..., Any] | None = None,
                   process_index: int | None = None) -> Callable[..., Any]:
        """Decorator: run ``function`` only on the process with global rank ``process_index``.

        Example:
            >>> @PartialState().on_process(process_index=1)
            ... def report(): ...
        """
        self._require_init()
        if function is None:
            return partial(self.on_process, process_index=process_index)
        if process_index is None:
            raise ValueError("on_process needs `process_index`, e.g. @state.on_process(process_index=1)")
        return function if self.process_index == process_index or not self.use_distributed else _do_nothing

    def on_local_process(self, function: Callable[..., Any] | None = None,
                         local_process_index: int | None = None) -> Callable[..., Any]:
        """Decorator: run ``function`` only on the process with local rank ``local_process_index``."""
        self._require_init()
        if function is None:
            return partial(self.on_local_process, local_process_index=local_process_index)
        if local_process_index is None:
            raise ValueError("on_local_process needs `local_process_index`")
        keep = self.local_process_index == local_process_index or not self.use_distributed
        return function if keep else _do_nothing

    def set_device(self) -> None:
        """Make this process's device current (``torch.cuda.set_device`` on GPUs)."""
        self.device_kind.setup(self.device)

    @classmethod
    def _reset_state(cls) -> None:
        """Forget the shared state (tests and notebooks); does not touch a running process group."""
        cls._shared_state.clear()


class AcceleratorState(_ProcessQueries):
    """``PartialState`` plus what the ``Accelerator`` decided: precision, plugins.

    Only the ``Accelerator`` creates it (``_from_accelerator=True``); afterwards ``AcceleratorState()``
    anywhere returns the same state.
    """

    _shared_state: dict[str, Any] = {}
    _mixed_precision: str
    _strategy: _RunStrategy  # the Accelerator's: the one source of distributed_type, is_fsdp2 and the plugins

    def __init__(self, mixed_precision: str | None = None, cpu: bool = False, dynamo_plugin: Any = None,
                 deepspeed_plugin: Any = None, fsdp_plugin: Any = None, torch_tp_plugin: Any = None,
                 megatron_lm_plugin: Any = None, parallelism_config: Any = None, _from_accelerator: bool = False,
                 **kwargs: Any) -> None:
        self.__dict__ = self._shared_state
        if self.initialized:
            if mixed_precision is not None and str(mixed_precision) != self._mixed_precision:
                raise ValueError(
                    f"AcceleratorState has already been initialized with mixed_precision={self._mixed_precision!r} "
                    f"and cannot be changed to {mixed_precision!r}; create one Accelerator per process, or call "
                    "`hasten.state.reset_state()` first (tests and notebooks).")
            return
        if not _from_accelerator:
            raise ValueError("Please make sure to properly initialize your accelerator via `accelerator = Accelerator()` "
                             "before using any functionality from the `hasten` library.")
        self._partial = PartialState(cpu, **kwargs)
        self._mixed_precision = str(mixed_precision or "no")
        self.dynamo_plugin = dynamo_plugin
        self.deepspeed_plugins = deepspeed_plugin
        self._requested_fsdp_plugin = fsdp_plugin  # answered until the Accelerator attaches its strategy
        self.torch_tp_plugin = torch_tp_plugin
        self.megatron_lm_plugin = megatron_lm_plugin
        self.parallelism_config = parallelism_config
        self.device_mesh = None

    @property
    def initialized(self) -> bool:
        return self._shared_state != {}

    @property
    def mixed_precision(self) -> str:
        return self._mixed_precision

    def __getattr__(self, name: str) -> Any:
        # Everything PartialState knows (device, process_index, ...) is readable here too.
        if name.startswith("__") or "_partial" not in self.__dict__:
            raise AttributeError(
                f"`AcceleratorState` object has no attribute `{name}`. This happens if "
                "`AcceleratorState._reset_state()` was called and an `Accelerator` was not reinitialized.")
        return getattr(self.__dict__["_partial"], name)

    def __repr__(self) -> str:
        return repr(self._partial) + f"Mixed precision type: {self.mixed_precision}\n"

    fork_launched = property(lambda self: bool(PartialState._shared_state.get("fork_launched", False)),
                             doc="Whether ``notebook_launcher``/``debug_launcher`` forked this process.")

    debug = property(lambda self: self._partial.debug, lambda self, value: setattr(self._partial, "debug", value),
                     doc="Debug mode (see ``PartialState.debug``); setting it here sets it for the whole process.")

    def get_deepspeed_plugin(self, name: str) -> Any:
        """The DeepSpeed plugin registered under ``name`` (``deepspeed_plugins`` as a dict)."""
        plugins = self.deepspeed_plugins
        if not isinstance(plugins, dict) or name not in plugins:
            raise ValueError(f"no DeepSpeed plugin named {name!r}; known: {list(plugins or {}) if isinstance(plugins, dict) else []}")
        return plugins[name]

    def select_deepspeed_plugin(self, name: str | None = None) -> None:
        """Make the plugin ``name`` the active one (the first of ``deepspeed_plugins`` when several are given)."""
        plugins = self.deepspeed_plugins
        if not isinstance(plugins, dict):
            raise ValueError("select_deepspeed_plugin needs several named plugins: `deepspeed_plugin={'a': ..., 'b': ...}`")
        chosen = self.get_deepspeed_plugin(name) if name is not None else next(iter(plugins.values()))
        self.deepspeed_plugins = {k: v for k, v in [(name, chosen)] + [(k, v) for k, v in plugins.items() if k != name]}

    def _attach_layout(self, parallelism_config: Any) -> None:
        """Keep the run's ``ParallelismConfig`` (as the ``Accelerator`` resolved it) and the mesh it carries."""
        self.parallelism_config = parallelism_config
        self.device_mesh = getattr(parallelism_config, "device_mesh", None)

    def _attach_strategy(self, strategy: _RunStrategy) -> None:
        """Make ``strategy`` (the Accelerator's) the source of ``distributed_type``, ``is_fsdp2`` and the plugins."""
        self.__dict__["_strategy"] = strategy

    @property
    def distributed_type(self) -> Any:  # type: ignore[override]
        """The strategy's ``DistributedType`` (FSDP, DEEPSPEED, ...); the process's before a strategy exists."""
        strategy = self.__dict__.get("_strategy")
        return strategy.distributed_type if strategy is not None else self._partial.distributed_type

    @property
    def is_fsdp2(self) -> bool:
        """True when the strategy shards with FSDP2 (hasten's only FSDP), as ``Accelerator.is_fsdp2``."""
        return bool(self.distributed_type == DistributedType.FSDP)

    @property
    def fsdp_plugin(self) -> Any:
        """The FSDP settings the strategy runs with (its default plugin when none was passed), else None."""
        strategy = self.__dict__.get("_strategy")
        return getattr(strategy, "fsdp_plugin", None) if strategy is not None else self._requested_fsdp_plugin

    @property
    def deepspeed_plugin(self) -> Any:
        """The active DeepSpeed plugin: the selected one of several, else the strategy's."""
        plugins = self.deepspeed_plugins
        if isinstance(plugins, dict):
            return next(iter(plugins.values()), None)
        strategy = self.__dict__.get("_strategy")
        return getattr(strategy, "deepspeed_plugin", None) if strategy is not None else plugins

    @classmethod
    def _reset_state(cls, reset_partial_state: bool = False) -> None:
        cls._shared_state.clear()
        if reset_partial_state:
            PartialState._reset_state()


class GradientState(_Borg):
    """Gradient-synchronisation state shared by the Accelerator, its optimizers and data loaders."""

    _shared_state: dict[str, Any] = {}

    def __init__(self, gradient_accumulation_plugin: GradientAccumulationPlugin | None = None) -> None:
        self.__dict__ = self._shared_state
        if not self.initialized:
            self.sync_gradients = True
            self._dataloader_references: list[Any] = [None]
            self.plugin_kwargs: dict[str, Any] = {}
        if gradient_accumulation_plugin is not None:
            plugin = gradient_accumulation_plugin
            self.plugin_kwargs = {"num_steps": plugin.num_steps or 1, "adjust_scheduler": plugin.adjust_scheduler,
                                  "sync_with_dataloader": plugin.sync_with_dataloader,
                                  "sync_each_batch": plugin.sync_each_batch}

    @property
    def initialized(self) -> bool:
        return self._shared_state != {}

    @property
    def num_steps(self) -> int:
        return int(self.plugin_kwargs.get("num_steps", 1))

    @property
    def is_xla_gradients_synced(self) -> bool:
        """Always False: hasten has no XLA engine."""
        return False

    @property
    def adjust_scheduler(self) -> bool:
        return bool(self.plugin_kwargs.get("adjust_scheduler", False))

    @property
    def sync_with_dataloader(self) -> bool:
        return bool(self.plugin_kwargs.get("sync_with_dataloader", True))

    @property
    def sync_each_batch(self) -> bool:
        return bool(self.plugin_kwargs.get("sync_each_batch", False))

    @property
    def active_dataloader(self) -> Any:
        return self._dataloader_references[-1]

    @property
    def end_of_dataloader(self) -> bool:
        loader = self.active_dataloader
        return bool(getattr(loader, "end_of_dataloader", False)) if loader is not None else False

    @property
    def remainder(self) -> int:
        loader = self.active_dataloader
        return int(getattr(loader, "remainder", -1)) if loader is not None else -1

    @property
    def in_dataloader(self) -> bool:
        return self.active_dataloader is not None

    @property
    def dataloader_references(self) -> list[Any]:
        return self._dataloader_references

    @dataloader_references.setter
    def dataloader_references(self, references: list[Any]) -> None:
        self._dataloader_references = references

    def _set_sync_gradients(self, sync_gradients: bool) -> None:
        self.sync_gradients = sync_gradients

    def _add_dataloader(self, dataloader: Any) -> None:
        self._dataloader_references.append(dataloader)

    def _remove_dataloader(self, dataloader: Any) -> None:
        if dataloader in self._dataloader_references[1:]:
            self._dataloader_references.remove(dataloader)

    def __repr__(self) -> str:
        return (f"Sync Gradients: {self.sync_gradients}\nAt end of current dataloader: {self.end_of_dataloader}\n"
                f"Extra samples added: {self.remainder}\nGradient accumulation plugin: {self.plugin_kwargs}\n")

    @classmethod
    def _reset_state(cls) -> None:
        cls._shared_state.clear()


def reset_state() -> None:
    """Forget every shared state object, for tests and notebooks.

    The process group is left alone: call ``PartialState().destroy_process_group()`` first to end it.

    Example:
        >>> reset_state()
    """
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    process_group.forget_hooks()


def wait_for_everyone() -> None:
    """Barrier across all processes (a no-op with one process); ``hasten.utils.wait_for_everyone``."""
    PartialState().wait_for_everyone()


# ------------------------------------------------------------------------------------------ helpers
def _limit_cpu_threads(device_kind: Device, info: ProcessInfo) -> None:
    # N processes on one machine each using every core oversubscribe it badly; share the cores out.
    if device_kind.name != "cpu" or is_env_set("OMP_NUM_THREADS"):
        return
    try:
        import psutil

        cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    except ImportError:  # pragma: no cover - psutil is a dependency
        cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // max(info.local_world_size, 1)))

# Names Accelerate's module at this path shows but defines elsewhere (hasten/_accelerate_shown.py).
__getattr__ = accelerate_path_getattr(__name__, globals())
