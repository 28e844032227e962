"""notebook_launcher from a plain script and from a real Jupyter kernel; debug_launcher; refusals."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from hasten.exceptions import LaunchError

# A 2-process training function: each rank takes half of the data, gradients are averaged across ranks,
# so the weights must equal full-batch gradient descent in one process (the ground truth).
TRAINING = textwrap.dedent("""
    import json, torch

    def make_data():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(16, 3, generator=g)
        return x, x @ torch.tensor([1.0, -2.0, 0.5]) + 0.1

    def step_all(w, x, y, steps):
        for _ in range(steps):
            w = w - 0.1 * (2 * x.T @ (x @ w - y) / len(y))
        return w

    def train(out_path, steps):
        import torch.distributed as dist
        from hasten import PartialState
        state = PartialState()
        x, y = make_data()
        with state.split_between_processes(list(range(len(y)))) as rows:
            xs, ys = x[rows], y[rows]
        w = torch.zeros(3)
        for _ in range(steps):
            grad = 2 * xs.T @ (xs @ w - ys) / len(ys)
            dist.all_reduce(grad)
            w = w - 0.1 * grad / state.num_processes
        if state.is_main_process:
            with open(out_path, "w") as f:
                json.dump({"w": w.tolist(), "n": state.num_processes,
                           "expected": step_all(torch.zeros(3), x, y, steps).tolist()}, f)
""")


def _check(result_path):
    result = json.loads(open(result_path).read())
    assert result["n"] == 2
    assert result["w"] == pytest.approx(result["expected"], abs=1e-5)


def _env(tmp_path):
    return dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", TMPDIR=str(tmp_path),
                HASTEN_HOME=str(tmp_path / "home"))


@pytest.mark.launch
def test_notebook_launcher_from_a_plain_script(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(TRAINING + textwrap.dedent(f"""
        if __name__ == "__main__":
            from hasten.launchers.notebook import notebook_launcher
            from hasten.exceptions import ConfigurationError
            notebook_launcher(train, args=({str(tmp_path / 'out.json')!r}, 5), num_processes=2)
            from hasten import PartialState
            PartialState()
            try:
                notebook_launcher(train, args=("unused", 1), num_processes=2)
            except ConfigurationError as exc:
                print("REFUSED:", exc)
    """))
    proc = subprocess.run([sys.executable, str(script)], env=_env(tmp_path), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    _check(tmp_path / "out.json")
    assert "REFUSED: A PartialState/Accelerator was already created" in proc.stdout


@pytest.mark.launch
def test_notebook_launcher_from_a_jupyter_kernel(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    for name in ("IPYTHONDIR", "JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR"):
        (tmp_path / name).mkdir()
    cells = [nbformat.v4.new_code_cell(TRAINING),
             nbformat.v4.new_code_cell("from hasten.launchers.notebook import notebook_launcher\n"
                                       f"notebook_launcher(train, args=({str(tmp_path / 'nb.json')!r}, 5), "
                                       "num_processes=2)")]
    notebook = nbformat.v4.new_notebook(cells=cells)
    env = {**_env(tmp_path), **{name: str(tmp_path / name) for name in
                                ("IPYTHONDIR", "JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR")}}
    old = dict(os.environ)
    os.environ.update(env)  # the kernel inherits the client's environment
    try:
        client = nbclient.NotebookClient(notebook, timeout=120, kernel_name="python3", resources={
            "metadata": {"path": str(tmp_path)}})
        client.execute()
    finally:
        os.environ.clear()
        os.environ.update(old)
    _check(tmp_path / "nb.json")


def _two_rank_sum(path):
    import torch

    from hasten import PartialState
    from hasten.ops.collectives import reduce

    state = PartialState()
    total = reduce(torch.tensor([float(state.process_index + 1)]), reduction="sum")
    if state.is_main_process:
        with open(path, "w") as f:
            json.dump({"n": state.num_processes, "sum": total.item(), "cpu": state.device.type}, f)


def _rank_one_fails():
    from hasten import PartialState

    state = PartialState()
    if state.process_index == 1:
        raise ValueError("rank one is broken")
    state.wait_for_everyone()


def test_debug_launcher_runs_cpu_ranks_and_reports_the_failing_rank(tmp_path):
    from hasten.launchers.notebook import debug_launcher

    debug_launcher(_two_rank_sum, args=(str(tmp_path / "d.json"),))
    assert json.loads((tmp_path / "d.json").read_text()) == {"n": 2, "sum": 3.0, "cpu": "cpu"}
    with pytest.raises(LaunchError, match=r"(?s)^debug_launcher: --- rank 1 ---.*ValueError: rank one is broken"):
        debug_launcher(_rank_one_fails)
