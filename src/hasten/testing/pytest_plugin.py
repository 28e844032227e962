"""pytest plugin: ``@pytest.mark.world_size(n)`` runs the test body on n forked gloo ranks.

Fixtures are resolved once in the parent and shared by the ranks (``tmp_path`` is the same folder
everywhere). Optional keyword arguments of the mark go to :func:`run_on_ranks`, e.g.
``@pytest.mark.world_size(2, pg_timeout=5, env={"HASTEN_DEBUG_MODE": "1"})``.

Two autouse fixtures keep tests independent: each starts and ends with no shared hasten state and no
process group, and none may leave ``MASTER_ADDR``, ``HASTEN_*`` or ``ACCELERATE_*`` set or changed in
the pytest process (a leaked launch variable silently changes what every later test runs).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest

from hasten._private_api import fixture_argnames
from hasten.testing.distributed import run_on_ranks


def _call_body(fn: Any, kwargs: dict[str, Any]) -> None:
    fn(**kwargs)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    marker = pyfuncitem.get_closest_marker("world_size")
    if marker is None:
        return None
    world_size = marker.args[0] if marker.args else 2
    kwargs = {name: pyfuncitem.funcargs[name] for name in fixture_argnames(pyfuncitem)}
    with tempfile.TemporaryDirectory(prefix="hasten-ranks-") as store_dir:
        run_on_ranks(_call_body, world_size=world_size, args=(pyfuncitem.obj, kwargs), tmp_dir=store_dir,
                     **marker.kwargs)
    return True


def pytest_configure(config: pytest.Config) -> None:
    """Point hasten's default configuration file at an empty folder for the session.

    A bare ``Accelerator()`` (plain ``python``, ``torchrun``, forked test ranks) reads the default
    ``hasten config`` file, so a developer's own file would change what the suite runs. Accelerate's own
    default file (under ``HF_HOME``) is left where it is: Accelerate's path constants, which the inventory
    tests compare, are computed from it. Tests that need a file name it (``HASTEN_HOME`` /
    ``ACCELERATE_CONFIG_FILE`` through ``monkeypatch``).
    """
    os.environ["HASTEN_HOME"] = tempfile.mkdtemp(prefix="hasten-test-home-")
    os.environ.pop("ACCELERATE_CONFIG_FILE", None)


@pytest.fixture(autouse=True)
def _hasten_clean_state() -> Any:
    """Each test starts and ends with no shared hasten state and no process group in the parent."""
    import torch.distributed as dist

    from hasten.state import reset_state

    reset_state()
    yield
    reset_state()
    assert not (dist.is_available() and dist.is_initialized()), "a test left a process group in the pytest process"


#: Variables that change what a later test's ``Accelerator``/``PartialState`` does when left behind.
LEAK_WATCHED_PREFIXES = ("HASTEN_", "ACCELERATE_")
LEAK_WATCHED_NAMES = ("MASTER_ADDR",)


def _watched_environment() -> dict[str, str]:
    return {key: value for key, value in os.environ.items()
            if key in LEAK_WATCHED_NAMES or key.startswith(LEAK_WATCHED_PREFIXES)}


@pytest.fixture(autouse=True)
def _hasten_no_environment_leak() -> Any:
    """Fail a test that leaves ``MASTER_ADDR``, ``HASTEN_*`` or ``ACCELERATE_*`` different from how it found
    them (use ``monkeypatch.setenv`` or ``patch_environment``); the variables are put back either way."""
    before = _watched_environment()
    yield
    after = _watched_environment()
    if after == before:
        return
    changed = sorted(key for key in set(before) | set(after) if before.get(key) != after.get(key))
    for key in changed:
        if key in before:
            os.environ[key] = before[key]
        else:
            del os.environ[key]
    pytest.fail(f"the test left environment variables set or changed: {changed}. HINT: set them with "
                "`monkeypatch.setenv` or `hasten.utils.patch_environment`, which put them back.", pytrace=False)
