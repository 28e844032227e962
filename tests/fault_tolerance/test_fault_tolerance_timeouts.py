"""Item 3 of issue 38: every fault-tolerance timeout comes from one setting; an order that cannot work is refused
at start, in one line naming both values (unit tests, and `hasten launch` refusing before any worker starts)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hasten.exceptions import ConfigurationError
from hasten.fault_tolerance import FaultToleranceConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("step", [0.5, 1.0, 5.0, 30.0, 600.0])
def test_derived_timeouts_keep_the_order(step: float) -> None:
    t = FaultToleranceConfig(step_timeout=step).timeouts()
    assert t.step == step
    assert t.heartbeat < t.step  # a dead group leaves the quorum before the survivors' collectives time out
    assert t.heartbeat_interval <= t.heartbeat / 5
    assert t.quorum >= 2 * t.step + t.join
    assert t.connect <= t.step
    assert t.collective >= t.quorum


@pytest.mark.parametrize("given, names", [
    ({"heartbeat_timeout": 10.0}, ("heartbeat_timeout=10 s", "step_timeout=10 s")),
    ({"quorum_timeout": 25.0}, ("quorum_timeout=25 s", "step_timeout=10 s", "join_timeout=10 s")),
    ({"connect_timeout": 11.0}, ("connect_timeout=11 s", "step_timeout=10 s")),
    ({"join_timeout": 20.0, "quorum_timeout": 30.0}, ("quorum_timeout=30 s", "join_timeout=20 s")),
])
def test_misordered_timeout_is_refused_naming_both_values(given: dict[str, float], names: tuple[str, ...]) -> None:
    with pytest.raises(ConfigurationError) as caught:
        FaultToleranceConfig(step_timeout=10.0, **given).timeouts()
    message = str(caught.value)
    assert "\n" not in message
    for name in names:
        assert name in message


def test_collective_timeout_below_the_quorum_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"collective_timeout=20 s must be at least quorum_timeout=30 s"):
        FaultToleranceConfig(step_timeout=10.0).timeouts(collective_timeout=20.0)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "10"])
def test_step_timeout_must_be_a_positive_number(bad: object) -> None:
    with pytest.raises(ConfigurationError, match="step_timeout"):
        FaultToleranceConfig(step_timeout=bad).timeouts()  # type: ignore[arg-type]


def test_settings_travel_to_workers_unchanged() -> None:
    config = FaultToleranceConfig(step_timeout=7.0, quorum_timeout=40.0, lighthouse="http://127.0.0.1:1")
    assert FaultToleranceConfig.from_json(config.to_json()) == config


@pytest.mark.launch
@pytest.mark.parametrize("flags, expected", [
    (["--step_timeout", "10", "--quorum_timeout", "5"], ["quorum_timeout=5 s", "step_timeout=10 s"]),
    (["--step_timeout", "10", "--collective_timeout", "20"], ["collective_timeout=20 s", "quorum_timeout=30 s"]),
    (["--replica_groups", "3"], ["--replica_groups=3", "--num_processes=2"]),
])
def test_launch_refuses_a_misordered_timeout_at_start(tmp_path: Path, flags: list[str], expected: list[str]) -> None:
    marker = tmp_path / "worker-ran"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    replica = [] if "--replica_groups" in flags else ["--replica_groups", "2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, "-m", "hasten.commands.main", "launch", "--cpu", "--num_processes", "2",
                           *replica, *flags, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, proc.stderr
    for text in expected:
        assert text in errors[0]
    assert not marker.exists()  # refused before any worker started


def test_accelerator_setting_resolves_from_code_then_the_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    from hasten.accelerator._fault_tolerance import resolve_fault_tolerance

    monkeypatch.delenv("HASTEN_FAULT_TOLERANCE", raising=False)
    assert resolve_fault_tolerance(None) is None  # not launched with --replica_groups: off
    assert resolve_fault_tolerance(True) == FaultToleranceConfig()
    given = FaultToleranceConfig(step_timeout=3.0)
    assert resolve_fault_tolerance(given) is given
    monkeypatch.setenv("HASTEN_FAULT_TOLERANCE", FaultToleranceConfig(step_timeout=9.0).to_json())
    assert resolve_fault_tolerance(None) == FaultToleranceConfig(step_timeout=9.0)
    assert resolve_fault_tolerance(False) is None  # code wins over the launch
    with pytest.raises(ConfigurationError, match="fault_tolerance=42"):
        resolve_fault_tolerance(42)
