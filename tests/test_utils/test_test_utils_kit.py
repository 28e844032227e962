"""hasten.test_utils as Accelerate's test kit: its distributed scripts run to the end under ``hasten launch``,
and its helpers (testing, examples) behave as Accelerate's do."""

from __future__ import annotations

import os
import subprocess
import sys
import unittest
from pathlib import Path

import pytest

import hasten.test_utils.scripts as scripts
from hasten.state import AcceleratorState
from hasten.test_utils import testing
from hasten.test_utils.examples import compare_against_test, get_function_contents_by_name


@pytest.mark.parametrize("script", ["test_ops.py", "test_sync.py", "test_distributed_data_loop.py"])
def test_distributed_script_runs_to_the_end_on_two_processes(tmp_path, script):
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", HASTEN_HOME=str(tmp_path / "home"),
               TMPDIR=str(tmp_path))
    env.pop("HASTEN_LAUNCH_CONFIG", None)
    path = Path(scripts.__file__).parent / script
    proc = subprocess.run([sys.executable, "-m", "hasten.commands.main", "launch", "--cpu", "--num_processes", "2",
                           str(path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "checks passed" in proc.stdout.splitlines()[-1], proc.stdout


def test_importing_the_kit_runs_no_script():
    code = ("import sys, hasten.test_utils as t; print(t.test_script.__name__, t.test_ops.__name__, "
            "'hasten.state' in sys.modules and __import__('hasten.state').state.PartialState._shared_state == {})")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["hasten.test_utils.scripts.test_script", "hasten.test_utils.scripts.test_ops", "True"]


def test_device_facts_and_default_launch_command_on_cpu():
    assert (testing.torch_device, testing.device_count) == ("cpu", 1)  # this machine has no accelerator
    assert testing.memory_allocated_func() == 0
    assert testing.DEFAULT_LAUNCH_COMMAND[-2:] == ["--num_processes=1", "--monitor_interval=0.1"]
    assert "launch" in testing.DEFAULT_LAUNCH_COMMAND


def test_accelerate_test_case_resets_the_shared_state():
    from hasten import Accelerator

    class Case(testing.AccelerateTestCase):
        def test_make(self):
            Accelerator()
            assert AcceleratorState._shared_state != {}

    result = unittest.TextTestRunner(stream=open(os.devnull, "w")).run(unittest.defaultTestLoader.loadTestsFromTestCase(Case))
    assert result.wasSuccessful()
    assert AcceleratorState._shared_state == {}


def test_temp_dir_test_case_empties_its_folder_before_each_test():
    seen = []

    class Case(testing.TempDirTestCase):
        def test_a(self):
            seen.append(sorted(p.name for p in self.tmpdir.iterdir()))
            (self.tmpdir / "left_over").write_text("x")

        def test_b(self):
            seen.append(sorted(p.name for p in self.tmpdir.iterdir()))

    result = unittest.TextTestRunner(stream=open(os.devnull, "w")).run(unittest.defaultTestLoader.loadTestsFromTestCase(Case))
    assert result.wasSuccessful() and seen == [[], []]
    assert not Case.tmpdir.exists()


def test_run_command_returns_output_and_raises_with_it():
    assert testing.run_command([sys.executable, "-c", "print('hi')"], return_stdout=True) == "hi\n"
    with pytest.raises(testing.SubprocessCallException, match="boom"):
        testing.run_command([sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"])


def test_package_decorators_skip_when_the_package_is_missing():
    @testing.require_swanlab  # not installed here
    class Case(unittest.TestCase):
        def test_x(self):
            pass

    assert getattr(Case, "__unittest_skip__", False) is (not __import__("hasten").utils.is_swanlab_available())


_TEMPLATE = """def training_function(config, args):
    model = build()
    for batch in loader:
        step(batch)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu", action="store_true")
    # a comment
    training_function(config, args)


if __name__ == "__main__":
    main()
"""


def test_compare_against_test_reports_what_a_feature_adds_that_the_complete_example_lacks(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # Accelerate's helper reads examples/nlp_example.py from the working directory
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples/nlp_example.py").write_text(_TEMPLATE)
    flag = '    parser.add_argument("--checkpointing_steps", type=str)\n'
    feature = _TEMPLATE.replace("    # a comment\n", "    # a comment\n" + flag)
    (tmp_path / "examples/feature.py").write_text(feature)
    (tmp_path / "examples/complete.py").write_text(_TEMPLATE)
    assert compare_against_test("examples/complete.py", "examples/feature.py", True) == [flag]
    (tmp_path / "examples/complete.py").write_text(feature)
    assert compare_against_test("examples/complete.py", "examples/feature.py", True) == []
    assert compare_against_test("examples/complete.py", "examples/feature.py", False) == []
    assert get_function_contents_by_name(_TEMPLATE.splitlines(keepends=True), "training_function")[0].startswith(
        "def training_function")
    with pytest.raises(ValueError, match="choose either 'main' or 'training_function'"):
        get_function_contents_by_name([], "other")
