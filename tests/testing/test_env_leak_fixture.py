"""The pytest plugin's env-leak fixture: a test that leaves MASTER_ADDR/HASTEN_*/ACCELERATE_* behind fails,
and the variables are put back so the next test runs as if it had never happened."""

import os
import subprocess
import sys
import textwrap

SUITE = textwrap.dedent("""
    import os

    def test_a_leaks():
        os.environ["MASTER_ADDR"] = "10.0.0.1"
        os.environ["HASTEN_LEAK_PROBE"] = "1"

    def test_b_sees_nothing_of_it():
        assert "MASTER_ADDR" not in os.environ and "HASTEN_LEAK_PROBE" not in os.environ

    def test_c_monkeypatch_is_fine(monkeypatch):
        monkeypatch.setenv("ACCELERATE_LEAK_PROBE", "1")

    def test_d_other_variables_are_not_watched():
        os.environ["OMP_LEAK_PROBE"] = "1"
""")


def test_a_test_that_leaves_launch_variables_fails_and_they_are_restored(tmp_path):
    (tmp_path / "test_leaky.py").write_text(SUITE)
    env = {k: v for k, v in os.environ.items() if k != "MASTER_ADDR" and not k.startswith(("HASTEN_", "ACCELERATE_"))}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "hasten.testing.pytest_plugin", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path / "test_leaky.py")],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert "4 passed, 1 error" in out and "ERROR test_leaky.py::test_a_leaks" in out, out
    assert "test_a_leaks" in out and "['HASTEN_LEAK_PROBE', 'MASTER_ADDR']" in out, out
