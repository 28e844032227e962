"""The one reader of ``HASTEN_*`` variables.

``hasten launch`` passes a single variable, ``HASTEN_LAUNCH_CONFIG`` (JSON of the launch configuration),
plus torchrun's standard variables. A few switches are also honoured on their own so that plain
``python``/``torchrun`` users can set them: ``HASTEN_DEBUG_MODE``, ``HASTEN_LOG_LEVEL`` and
``HASTEN_COLLECTIVE_TIMEOUT`` (seconds; what ``hasten launch --collective_timeout`` sets).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from hasten.config.schema import LaunchConfig
from hasten.utils.environment import as_bool

LAUNCH_CONFIG_VAR = "HASTEN_LAUNCH_CONFIG"
DEBUG_MODE_VAR = "HASTEN_DEBUG_MODE"
LOG_LEVEL_VAR = "HASTEN_LOG_LEVEL"
COLLECTIVE_TIMEOUT_VAR = "HASTEN_COLLECTIVE_TIMEOUT"


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def launch_config_dict(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The launch configuration passed by ``hasten launch`` as a plain dict ({} when absent)."""
    raw = _env(env).get(LAUNCH_CONFIG_VAR)
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{LAUNCH_CONFIG_VAR} is not valid JSON ({exc}); it is written by `hasten launch`, "
                         "unset it if you set it by hand") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{LAUNCH_CONFIG_VAR} must hold a JSON object, got {type(value).__name__}")
    return value


def accelerate_torch_device(env: Mapping[str, str] | None = None) -> str | None:
    """Accelerate's ``ACCELERATE_TORCH_DEVICE`` (a device such as ``"cpu:64"`` that overrides the chosen
    one), or None when unset."""
    return _env(env).get("ACCELERATE_TORCH_DEVICE") or None


def accelerate_parallelism_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Accelerate's ``PARALLELISM_CONFIG_*`` variables (its launcher's channel for ``ParallelismConfig``), as
    ``parallelism_config_*`` keys of a launch configuration's ``parallelism_config`` block."""
    prefix = "PARALLELISM_CONFIG_"
    return {f"parallelism_config_{key[len(prefix):].lower()}": value for key, value in _env(env).items()
            if key.startswith(prefix)}


def launch_config(env: Mapping[str, str] | None = None) -> LaunchConfig | None:
    """The typed launch configuration passed by ``hasten launch`` (``None`` when not launched by it).

    Raises:
        ConfigurationError: the variable does not match the ``LaunchConfig`` schema.
    """
    data = launch_config_dict(env)
    return LaunchConfig.from_launch_dict(data) if data else None


def launch_config_to_env(config: Mapping[str, Any]) -> dict[str, str]:
    """Encode a launch configuration for a worker's environment."""
    return {LAUNCH_CONFIG_VAR: json.dumps(dict(config), sort_keys=True)}


def debug_mode(env: Mapping[str, str] | None = None) -> bool:
    """True when cross-rank checks of collectives are on (``HASTEN_DEBUG_MODE=1`` or ``launch --debug``)."""
    env = _env(env)
    raw = env.get(DEBUG_MODE_VAR)
    if raw is not None:
        return as_bool(raw, DEBUG_MODE_VAR) if raw.strip() else False
    return bool(launch_config_dict(env).get("debug", False))


def log_level(env: Mapping[str, str] | None = None) -> str | None:
    """The level named by ``HASTEN_LOG_LEVEL``, if any."""
    return _env(env).get(LOG_LEVEL_VAR)


def test_start_method(env: Mapping[str, str] | None = None) -> str:
    """How the test harness starts ranks: ``fork`` (default, fast) or ``spawn`` (``HASTEN_TEST_START_METHOD``)."""
    return _env(env).get("HASTEN_TEST_START_METHOD", "fork")


def collective_timeout(env: Mapping[str, str] | None = None) -> timedelta | None:
    """The hang bound set by ``hasten launch --collective_timeout`` (``HASTEN_COLLECTIVE_TIMEOUT``, seconds)."""
    raw = _env(env).get(COLLECTIVE_TIMEOUT_VAR)
    if not raw:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise ValueError(f"{COLLECTIVE_TIMEOUT_VAR}={raw!r} must be a number of seconds above 0.")
    return timedelta(seconds=seconds)
