"""Every private API hasten touches (torch, CPython, pytest), named in one place and each guarded.

Private APIs are normal in this field (torchtitan flattens meshes with ``DeviceMesh._flatten`` too);
what matters is that they are listed, checked against the installed version, and fail with a clear
message instead of an ``AttributeError`` deep inside a run. Each accessor below says what it falls back
to, or raises :class:`PrivateAPIError` naming the API, the installed torch and what to do.
``tests/test_private_api.py`` exercises every one of them on the torch version it is pinned to, and
fails loudly when torch moves, so the list is re-checked on each upgrade.

Nothing else in ``src/hasten`` may reach these names (a house rule greps for them).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from hasten.exceptions import HastenError

#: The torch release every accessor was last checked against (``tests/test_private_api.py``).
CHECKED_TORCH = "2.13"


class PrivateAPIError(HastenError, RuntimeError):
    """A private API hasten relies on is missing or changed in the installed torch."""


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def _missing(api: str, needed_for: str) -> PrivateAPIError:
    return PrivateAPIError(
        f"{api} is not available in torch {_torch_version()} (hasten was checked against torch {CHECKED_TORCH}); "
        f"{needed_for} needs it. HINT: install torch {CHECKED_TORCH}.x, or report this so "
        "hasten/_private_api.py can follow the change.")


def _import(module: str, name: str, needed_for: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise _missing(f"{module}.{name}", needed_for) from exc


# --------------------------------------------------------------------------------- torch.distributed
def clone_default_store() -> Any:
    """A second handle on the default group's store (``_get_default_store().clone()``) for another thread.

    Falls back to None (the caller then runs without the hang watchdog; the group's own timeout
    still bounds hangs).
    """
    import torch.distributed as dist

    try:
        # torch's stub for Store lacks clone(), which every c10d store has (one clone per thread is the rule)
        return dist.distributed_c10d._get_default_store().clone()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - no default store, or a store without clone()
        return None


def flatten_mesh(mesh: Any, name: str) -> Any:
    """``DeviceMesh._flatten(name)``: a named one-dimensional view over several mesh dimensions.

    Raises:
        PrivateAPIError: the method is gone.
    """
    flatten = getattr(mesh, "_flatten", None)
    if flatten is None:
        raise _missing("DeviceMesh._flatten", "the flattened data-parallel mesh views ('dp', 'dp_cp', ...)")
    return flatten(name)


def set_unshard_async(module: Any) -> bool:
    """``FSDPModule._set_unshard_async_op(True)``; False (nothing changed) when this torch lacks it."""
    switch = getattr(module, "_set_unshard_async_op", None)
    if switch is None:
        return False
    switch(True)
    return True


def has_unshard_async(module: Any) -> bool:
    """Whether :func:`set_unshard_async` can act on ``module``."""
    return hasattr(module, "_set_unshard_async_op")


def fsdp_param_records(module: Any) -> list[Any]:
    """The per-parameter records (``FSDPParam``) of one ``FSDPModule``: ``_get_fsdp_state()._fsdp_param_group``.

    Raises:
        PrivateAPIError: FSDP2's state or parameter group moved (the mid-window save cannot read the
            pending gradients then).
    """
    try:
        group = module._get_fsdp_state()._fsdp_param_group
    except AttributeError as exc:
        raise _missing("FSDPModule._get_fsdp_state()._fsdp_param_group",
                       "saving inside an accumulation window under FSDP2") from exc
    return list(group.fsdp_params) if group is not None else []


def pending_gradient(record: Any) -> Any:
    """An ``FSDPParam``'s gradient accumulated under ``no_sync`` and not yet reduce-scattered (or None):
    ``unsharded_accumulated_grad``, else ``_unsharded_param.grad``.

    Raises:
        PrivateAPIError: the record lacks ``unsharded_accumulated_grad``.
    """
    if not hasattr(record, "unsharded_accumulated_grad"):
        raise _missing("FSDPParam.unsharded_accumulated_grad", "saving inside an accumulation window under FSDP2")
    pending = record.unsharded_accumulated_grad
    if pending is None and hasattr(record, "_unsharded_param"):
        pending = record._unsharded_param.grad
    return pending


def set_pending_gradient(record: Any, grad: Any) -> None:
    """Give an ``FSDPParam`` back a pending gradient (a DTensor on its unsharded spec under tensor parallel)."""
    if not hasattr(record, "unsharded_accumulated_grad"):
        raise _missing("FSDPParam.unsharded_accumulated_grad", "resuming inside an accumulation window under FSDP2")
    spec = getattr(record, "_unsharded_dtensor_spec", None)  # a tensor-parallel parameter
    if spec is not None:
        from torch.distributed.tensor import DTensor

        grad = DTensor.from_local(grad, spec.mesh, spec.placements, run_check=False)
    record.unsharded_accumulated_grad = grad


def composable_checkpoint() -> Callable[..., Any]:
    """``torch.distributed._composable.checkpoint``: activation checkpointing that composes with ``fully_shard``."""
    return _import("torch.distributed._composable", "checkpoint", "FSDP2 activation checkpointing")


def apply_activation_checkpointing() -> Callable[..., Any]:
    """``torch.distributed.algorithms._checkpoint.checkpoint_wrapper.apply_activation_checkpointing``."""
    return _import("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "apply_activation_checkpointing",
                   "fsdp2_apply_ac")


def set_rotate_method(method: str) -> None:
    """Context parallel's ring rotation (``allgather``/``alltoall``): ``tensor.experimental._attention``."""
    _import("torch.distributed.tensor.experimental._attention", "set_rotate_method", "context parallelism")(method)


# ------------------------------------------------------------------------- memory planning (fake runs)
def fake_tensor_mode() -> Any:
    """A new ``torch._subclasses.fake_tensor.FakeTensorMode``: tensors with shapes and no storage.

    Raises:
        PrivateAPIError: torch moved it (``hasten.plan_memory`` cannot run a step without allocating then).
    """
    return _import("torch._subclasses.fake_tensor", "FakeTensorMode", "hasten.plan_memory")()


def fake_process_group_store() -> Any:
    """A ``FakeStore`` (``torch.testing._internal.distributed.fake_pg``) for the ``"fake"`` backend, whose
    collectives return at once, so a process group of any world size exists in one process."""
    return _import("torch.testing._internal.distributed.fake_pg", "FakeStore", "hasten.plan_memory")()


def memory_tracker(fsdp_module: Any = None, optimizer: Any = None) -> Any:
    """torch's memory tracker (``torch.distributed._tools``): ``FSDPMemTracker(fsdp_module, optimizer)``
    for an FSDP2 model, else ``MemTracker()``; both work on fake and real tensors alike."""
    if fsdp_module is None:
        return _import("torch.distributed._tools.mem_tracker", "MemTracker", "hasten.plan_memory")()
    tracker = _import("torch.distributed._tools.fsdp2_mem_tracker", "FSDPMemTracker", "hasten.plan_memory")
    return tracker(fsdp_module, optimizer)


def always_stepping_grad_scaler(device_type: str) -> Any:
    """A ``torch.amp.GradScaler`` whose ``step`` runs the optimizer without reading ``found_inf``.

    Why: ``GradScaler._maybe_opt_step`` decides with ``found_inf.item()``, which fake tensors cannot answer; a
    memory plan wants the step that runs (finite gradients), with the scaler's own tensors and its unscale
    temporaries as a real step has them. Raises PrivateAPIError when the hook moved.
    """
    import torch

    class _AlwaysStepping(torch.amp.GradScaler):
        def _maybe_opt_step(self, optimizer: Any, optimizer_state: Any, *args: Any, **kwargs: Any) -> Any:
            return optimizer.step(*args, **kwargs)

    if not hasattr(torch.amp.GradScaler, "_maybe_opt_step"):
        raise _missing("torch.amp.GradScaler._maybe_opt_step", "hasten.plan_memory (mixed_precision='fp16')")
    return _AlwaysStepping(device_type)


@contextmanager
def dtensor_propagation_in_own_fake_mode() -> Iterator[None]:
    """While a plan runs, DTensor's shape propagation (``tensor._sharding_prop.detect_fake_mode``) makes its
    own fake mode instead of joining the plan's.

    Why: DTensor computes output metadata by running each op on global-shape fake tensors, under the active
    fake mode if there is one. Torch's memory tracker skips those ops only when they run under another fake
    mode than its own (as in a real run), so under the plan's mode it would count full-size tensors that a
    real run never allocates (a multi-tensor optimizer step over FSDP2 shards planned 1.8x its measured peak).
    Falls back to leaving torch as it is (the plan may then overcount) when the hook moved.
    """
    try:
        module = importlib.import_module("torch.distributed.tensor._sharding_prop")
    except ImportError:
        module = None
    original = getattr(module, "detect_fake_mode", None)
    if original is None:
        yield
        return
    module.detect_fake_mode = lambda *args, **kwargs: None  # type: ignore[union-attr]
    try:
        yield
    finally:
        module.detect_fake_mode = original  # type: ignore[union-attr]

@contextmanager
def device_mesh_tensors_outside_fake_mode() -> Iterator[None]:
    """While a plan runs, a ``DeviceMesh``'s own rank tensors (built in ``__init__``, read through its ``mesh``
    property) are computed for real.

    Why: FSDP2 over a tensor-parallel mesh builds new meshes inside ``fully_shard`` (``DeviceMesh._concatenate``),
    which index the mesh's real rank tensor; under the plan's fake mode those ops refuse a real input. They
    are a few integers (one per rank), computed the same way in a real run, so the plan stays exact. Falls
    back to leaving torch as it is (tensor-parallel plans then fail with one line) when these moved.
    """
    from torch.distributed.device_mesh import DeviceMesh

    unset_fake = _import("torch._subclasses.fake_tensor", "unset_fake_temporarily", "hasten.plan_memory")
    init, mesh = DeviceMesh.__dict__.get("__init__"), DeviceMesh.__dict__.get("mesh")
    if not callable(init) or not isinstance(mesh, property) or mesh.fget is None:
        yield
        return
    getter = mesh.fget

    def init_for_real(self: Any, *args: Any, **kwargs: Any) -> None:
        with unset_fake():
            init(self, *args, **kwargs)

    def mesh_for_real(self: Any) -> Any:
        with unset_fake():
            return getter(self)

    patched: Any = DeviceMesh  # the class itself, its methods replaced for the plan's duration
    patched.__init__, patched.mesh = init_for_real, property(mesh_for_real)
    try:
        yield
    finally:
        patched.__init__, patched.mesh = init, mesh


def clear_dtensor_caches() -> None:
    """Empty DTensor's caches of sharding propagation and redistribution plans (a plan's fake world is new).

    Why: those caches are keyed by ``DeviceMesh``, whose equality ignores its process groups; each plan starts a
    new fake process group whose groups reuse the previous plan's names for other ranks, so a cached result
    holding the previous plan's mesh would run its collectives on the wrong group (a tensor-parallel plan after
    another plan failed with a wrong all-gather size). Falls back to clearing what is still there.
    """
    for module, name in (("torch.distributed.tensor.debug", "_clear_sharding_prop_cache"),
                         ("torch.distributed.tensor._redistribute", "clear_redistribute_planner_cache")):
        clear = getattr(importlib.import_module(module), name, None)
        if callable(clear):
            clear()
    transform_infos: Any = getattr(importlib.import_module("torch.distributed.tensor._redistribute"),
                                   "_gen_transform_infos", None)
    if hasattr(transform_infos, "cache_clear"):
        transform_infos.cache_clear()


# ---------------------------------------------------------------------------------------- torch core
def to_call_device(*args: Any, **kwargs: Any) -> Any:
    """The device a ``Module.to(*args, **kwargs)`` call names (None for a dtype-only call): ``torch._C._nn._parse_to``.

    Falls back to "a device is named" (the caller then warns on every ``to``) when the parser moved.
    """
    import torch

    parse = getattr(getattr(torch._C, "_nn", None), "_parse_to", None)
    if parse is None:
        return "unknown"
    return parse(*args, **kwargs)[0]


# ------------------------------------------------------------------------------------ CPython, pytest
def run_exit_functions() -> None:
    """Run the ``atexit`` functions now (``atexit._run_exitfuncs``), before an ``os._exit`` skips them.

    Raises:
        PrivateAPIError: the interpreter has no such function (then ``os._exit`` would skip teardown).
    """
    import atexit

    run = getattr(atexit, "_run_exitfuncs", None)
    if run is None:
        raise PrivateAPIError("atexit._run_exitfuncs is missing in this Python: hasten's worker bootstrap cannot "
                              "run the exit functions before leaving. Use CPython 3.10-3.13.")
    run()


def run_before_threads_join(function: Callable[[], None]) -> bool:
    """Run ``function`` at interpreter exit before non-daemon threads are joined: ``threading._register_atexit``.

    That is before ``concurrent.futures`` refuses new work ("cannot schedule new futures after
    interpreter shutdown") when ``function`` is registered after it (they run newest first), and before
    ``atexit`` functions (the process group's teardown). Returns False when the interpreter is already
    shutting down (too late to register).

    Raises:
        PrivateAPIError: the interpreter has no such function.
    """
    import threading

    register = getattr(threading, "_register_atexit", None)
    if register is None:
        raise PrivateAPIError("threading._register_atexit is missing in this Python: hasten cannot finish an "
                              "asynchronous save at exit. Use CPython 3.10-3.13, or call "
                              "accelerator.wait_for_checkpoint() before the script ends.")
    try:
        register(function)
    except RuntimeError:  # "can't register atexit after shutdown"
        return False
    return True


def fixture_argnames(item: Any) -> tuple[str, ...]:
    """The fixture names a pytest test function asks for (``item._fixtureinfo.argnames``).

    Raises:
        PrivateAPIError: pytest moved it.
    """
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        raise PrivateAPIError("pytest's Function._fixtureinfo is gone: the world_size mark cannot hand fixtures to "
                              "the ranks. Use the pytest version pinned in pyproject.toml.")
    return tuple(info.argnames)


# ------------------------------------------------------------------------------------------- torchft
def forget_failed_quorum(manager: Any) -> None:
    """Let a torchft ``Manager`` start a new quorum after one failed (``manager._quorum_future = None``).

    torchft 0.2.0's ``start_quorum`` first waits on the previous quorum's future and re-raises its error,
    so a quorum that timed out would fail every later one; nothing else of the failed quorum is kept (its
    process group was not reconfigured, the step did not start).

    Raises:
        PrivateAPIError: torchft moved it (hasten pins torchft==0.2.0).
    """
    if not hasattr(manager, "_quorum_future"):
        raise PrivateAPIError("torchft's Manager._quorum_future is gone: hasten cannot retry a quorum that timed "
                              "out. Use torchft==0.2.0 (hasten[torchft]).")
    manager._quorum_future = None


#: Every name above, for the house rule that keeps them here.
PRIVATE_NAMES = ("_get_default_store", "_flatten(", "_set_unshard_async_op", "_get_fsdp_state", "_fsdp_param_group",
                 "_unsharded_", "unsharded_accumulated_grad", "distributed._composable", "algorithms._checkpoint",
                 "experimental._attention", "_parse_to", "_run_exitfuncs", "_register_atexit", "_fixtureinfo",
                 "_subclasses", "_internal.distributed", "distributed._tools", "_sharding_prop",
                 "_clear_sharding_prop_cache", "tensor._redistribute", "_quorum_future")

__all__ = ["CHECKED_TORCH", "PRIVATE_NAMES", "PrivateAPIError", "apply_activation_checkpointing", "clear_dtensor_caches",
           "clone_default_store",
           "composable_checkpoint", "device_mesh_tensors_outside_fake_mode", "dtensor_propagation_in_own_fake_mode",
           "fake_process_group_store",
           "fake_tensor_mode", "fixture_argnames", "flatten_mesh", "forget_failed_quorum", "fsdp_param_records", "has_unshard_async",
           "memory_tracker", "pending_gradient", "run_before_threads_join", "run_exit_functions",
           "set_pending_gradient", "set_rotate_method", "set_unshard_async", "to_call_device"]
