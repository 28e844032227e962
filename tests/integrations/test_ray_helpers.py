"""``hasten.integrations.ray`` outside a Ray Train worker: clear errors, and ``ray`` imported only when used."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hasten.exceptions import ConfigurationError, MissingDependencyError

ROOT = Path(__file__).resolve().parents[2]


def test_importing_hasten_and_the_module_does_not_import_ray():
    code = "import sys, hasten, hasten.integrations.ray; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_without_ray_each_helper_names_the_package_to_install():
    if subprocess.run([sys.executable, "-c", "import ray"], capture_output=True, timeout=120).returncode == 0:
        pytest.skip("this interpreter has ray")  # .venv has none; the Ray interpreter is checked below
    from hasten.integrations import ray as hasten_ray

    for call in (lambda: hasten_ray.report(None, {}), lambda: hasten_ray.load_checkpoint(None),
                 lambda: hasten_ray.save_if_preempted(None, {})):
        with pytest.raises(MissingDependencyError, match=r"pip install ray\[train\]"):
            call()


def test_outside_a_ray_train_worker_each_helper_says_where_to_call_it():
    python = Path(os.environ.get("HASTEN_RAY_PYTHON") or ROOT / ".ray-venv" / "bin" / "python")
    if not python.exists():
        pytest.fail(f"no interpreter at {python} ($HASTEN_RAY_PYTHON): run `make ray-venv` (`make test` builds it)")
    code = ("from hasten.integrations import ray as r\n"
            "for name in ('report', 'load_checkpoint', 'save_if_preempted'):\n"
            "    try:\n"
            "        getattr(r, name)(None, {}) if name != 'load_checkpoint' else r.load_checkpoint(None)\n"
            "    except Exception as exc:\n"
            "        print(type(exc).__name__, exc)\n")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=180,
                         env=dict(os.environ, PYTHONPATH=str(ROOT / "src"), RAY_USAGE_STATS_ENABLED="0"))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 3, out.stdout + out.stderr
    for name, line in zip(("report", "load_checkpoint", "save_if_preempted"), lines):
        assert line.startswith(f"{ConfigurationError.__name__} hasten.integrations.ray.{name}() was called outside "
                               "a Ray Train worker"), line
        assert "TorchTrainer" in line


class _FakeTrain:
    """Stands in for ``ray.train`` inside a worker: records reports, gives the preemption notice it is told."""

    class Checkpoint:
        def __init__(self, path):
            self.path = path

        @classmethod
        def from_directory(cls, path):
            return cls(path)

    def __init__(self):
        self.reports, self.notice = [], None

    def get_context(self):
        return object()

    def report(self, metrics, checkpoint=None, checkpoint_dir_name=None):
        self.reports.append((metrics, checkpoint and checkpoint.path, checkpoint_dir_name))

    def get_preemption_info(self):
        return self.notice


class _FakeAccelerator:
    def __init__(self, local_process_index):
        self.local_process_index, self.saved = local_process_index, []

    def save_state(self, output_dir=None):
        self.saved.append(output_dir)
        return Path(output_dir)

    def wait_for_checkpoint(self):
        pass


@pytest.fixture
def fake_train(monkeypatch):
    import types

    train = _FakeTrain()
    ray = types.ModuleType("ray")
    ray.train = train
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setitem(sys.modules, "ray.train", train)
    from hasten.integrations import ray as hasten_ray

    monkeypatch.setitem(hasten_ray._ANSWERED, "notice", None)
    return train


def test_report_hands_the_folder_from_the_first_worker_of_a_machine_only(fake_train, tmp_path):
    from hasten.integrations.ray import report

    for local_index in (0, 1):
        assert report(_FakeAccelerator(local_index), {"step": 2}, tmp_path / "step_2") == tmp_path / "step_2"
    assert fake_train.reports == [({"step": 2}, str(tmp_path / "step_2"), "step_2"), ({"step": 2}, None, "step_2")]


def test_a_preemption_notice_saves_and_reports_once(fake_train, tmp_path):
    import types

    from hasten.integrations.ray import save_if_preempted

    accelerator = _FakeAccelerator(0)
    assert save_if_preempted(accelerator, {"step": 5}, tmp_path / "step_5") is None  # no notice: nothing
    fake_train.notice = types.SimpleNamespace(preempted_node_ids=["node-a"])
    assert save_if_preempted(accelerator, {"step": 6}, tmp_path / "step_6") == tmp_path / "step_6"
    assert save_if_preempted(accelerator, {"step": 7}, tmp_path / "step_7") is None  # the same notice: answered
    fake_train.notice = types.SimpleNamespace(preempted_node_ids=["node-a", "node-b"])  # a new node drains
    assert save_if_preempted(accelerator, {"step": 8}, tmp_path / "step_8") == tmp_path / "step_8"
    assert accelerator.saved == [tmp_path / "step_6", tmp_path / "step_8"]
    assert [r[0]["step"] for r in fake_train.reports] == [6, 8]
