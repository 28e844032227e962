"""pytest plugin: ``@pytest.mark.world_size(n)`` runs the test body on n forked gloo ranks.

Fixtures are resolved once in the parent and shared by the ranks (``tmp_path`` is the same folder
everywhere). Optional keyword arguments of the mark go to :func:`run_on_ranks`, e.g.
``@pytest.mark.world_size(2, pg_timeout=5, env={"HASTEN_DEBUG_MODE": "1"})``.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest

from hasten.testing.distributed import run_on_ranks


def _call_body(fn: Any, kwargs: dict[str, Any]) -> None:
    fn(**kwargs)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    marker = pyfuncitem.get_closest_marker("world_size")
    if marker is None:
        return None
    world_size = marker.args[0] if marker.args else 2
    kwargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    with tempfile.TemporaryDirectory(prefix="hasten-ranks-") as store_dir:
        run_on_ranks(_call_body, world_size=world_size, args=(pyfuncitem.obj, kwargs), tmp_dir=store_dir,
                     **marker.kwargs)
    return True


@pytest.fixture(autouse=True)
def _hasten_clean_state() -> Any:
    """Each test starts and ends with no shared hasten state and no process group in the parent."""
    import torch.distributed as dist

    from hasten.state import reset_state

    reset_state()
    yield
    reset_state()
    assert not (dist.is_available() and dist.is_initialized()), "a test left a process group in the pytest process"
