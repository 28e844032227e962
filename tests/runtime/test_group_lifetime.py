"""The process group's whole lifetime has one owner (``runtime/process_group.py``): however a group
is started (one process, a private one-rank group, the test harness, ``notebook_launcher``, ``hasten
launch`` with an elastic restart) and ended, nothing hangs on afterwards: no watchdog thread, no
release hook, no group, no debug checks, no replaced ``sys.excepthook``, and one ``atexit`` at most.
"""

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch.distributed as dist

from hasten.runtime import process_group
from hasten.runtime.debug_checks import debug_checks_enabled


def _hasten_excepthook():
    """True while hasten's failure-report hook is ``sys.excepthook`` (torch's own may wrap or sit below it)."""
    return "_record_then_report" in getattr(sys.excepthook, "__qualname__", "")


def _leftovers():
    """What still hangs on the group in this process (all empty/False when the lifetime ended cleanly)."""
    return {"group": dist.is_initialized(),
            "watchdog": [t.name for t in threading.enumerate() if t.name == "hasten-watchdog"],
            "hooks": list(process_group._BEFORE_END),
            "debug": debug_checks_enabled(),
            "excepthook": _hasten_excepthook()}


CLEAN = {"group": False, "watchdog": [], "hooks": [], "debug": False, "excepthook": False}


def test_state_py_starts_no_thread_and_registers_no_hook():
    source = (process_group.__file__.rsplit("runtime", 1)[0] + "state.py")
    text = open(source).read()
    for needle in ("atexit", "excepthook", "start_watchdog", "stop_watchdog", "new_group", "enable_debug_checks"):
        assert needle not in text, f"state.py still handles {needle}: the group's lifetime belongs to process_group"


def test_single_process_leaves_nothing():
    from hasten.state import PartialState

    state = PartialState()
    assert state.num_processes == 1 and _leftovers() == CLEAN
    state.destroy_process_group()
    assert _leftovers() == CLEAN


@pytest.fixture(scope="module")
def _dynamo_in_parent():
    # torch's optimizers and DDP import torch._dynamo (~2 CPU-s): once here, not in every forked rank
    import torch._dynamo  # noqa: F401


@pytest.mark.world_size(2)
@pytest.mark.usefixtures("_dynamo_in_parent")
@pytest.mark.parametrize("held_in_a_cycle", [False, True], ids=["plain", "cycle"])
def test_ddp_reducers_die_before_the_group_ends_and_a_full_collection_only_when_needed(monkeypatch, held_in_a_cycle):
    """A live DDP reducer when the gloo group is destroyed aborts some runs at exit: ``end_training``
    frees the reducers first. Plainly held, dropping the wrapper's references frees them, and the full
    ``gc.collect()`` (0.2+ CPU-s once torch._dynamo is loaded) is skipped; held by an unreachable
    reference cycle, the collection runs and frees them too."""
    import gc
    import weakref

    import torch

    from hasten import Accelerator
    from hasten.state import reset_state

    reset_state()
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    accelerator.backward(model(torch.ones(1, 2)).sum())
    optimizer.step()
    reducer, logger = weakref.ref(model.reducer), weakref.ref(model.logger)
    collections = []
    real_collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: collections.append(a) or real_collect(*a))
    gc.disable()  # no automatic collection in between: only release() may free a cycle
    try:
        if held_in_a_cycle:
            cycle: dict = {"reducer": model.reducer}
            cycle["self"] = cycle
            del cycle
        accelerator.end_training()
    finally:
        gc.enable()
    assert reducer() is None and logger() is None
    assert not dist.is_initialized()
    assert len(collections) == (1 if held_in_a_cycle else 0)
    reset_state()


PRIVATE_GROUP = textwrap.dedent("""
    import atexit, json, sys, threading
    registered = []
    atexit.register = lambda fn, *a, **k: registered.append(fn)  # count, and keep the exit quiet
    import torch
    import torch.distributed as dist
    from hasten import Accelerator, FullyShardedDataParallelPlugin
    from hasten.runtime import process_group
    from hasten.runtime.debug_checks import debug_checks_enabled
    from hasten.state import reset_state

    reports = []
    for _ in range(2):
        accelerator = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
        model = torch.nn.Linear(2, 2)
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        accelerator.backward(model(torch.ones(1, 2)).sum())
        during = dist.is_initialized() and bool(process_group._BEFORE_END)  # the strategy's release is registered
        accelerator.end_training()
        reports.append({"during": during, "group": dist.is_initialized(),
                        "watchdog": any(t.name == "hasten-watchdog" for t in threading.enumerate()),
                        "hooks": len(process_group._BEFORE_END), "debug": debug_checks_enabled(),
                        "excepthook": "_record_then_report" in getattr(sys.excepthook, "__qualname__", "")})
        reset_state()
    ours = [fn.__qualname__ for fn in registered if (getattr(fn, "__module__", None) or "").startswith("hasten")]
    print("REPORT " + json.dumps({"runs": reports, "atexit": ours}), flush=True)
""")


def test_private_one_rank_group_ends_with_one_atexit_for_every_restart(tmp_path):
    """A strategy's private group (FSDP2 alone), started and ended twice: one atexit, nothing left.

    In a fresh interpreter: a gloo group in the pytest process would be inherited by the ranks the
    harness forks later.
    """
    script = tmp_path / "private.py"
    script.write_text(PRIVATE_GROUP)
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout.split("REPORT ", 1)[1].splitlines()[0])
    clean = {"during": True, "group": False, "watchdog": False, "hooks": 0, "debug": False, "excepthook": False}
    assert report == {"runs": [clean, clean], "atexit": ["end_group"]}


@pytest.mark.world_size(2)
def test_harness_group_watched_then_ended_and_restarted_leaves_nothing(tmp_path):
    """An adopted group gets a watchdog and debug checks; ending it takes both away; a second group
    in the same process (a restart) gets exactly one new watchdog, and ends as cleanly."""
    import datetime

    from hasten.state import PartialState, reset_state

    for attempt in range(2):
        if attempt:  # the harness started the first group; the restart starts its own
            store = dist.FileStore(str(tmp_path / "restart_store"), 2)
            process_group.start_group(backend="gloo", store=store, rank=int(os.environ["RANK"]), world_size=2,
                                      timeout=datetime.timedelta(seconds=60))
        state = PartialState()
        state.debug = True
        state.wait_for_everyone()
        running = _leftovers()
        assert running["group"] and running["watchdog"] == ["hasten-watchdog"] and running["debug"], running
        assert not running["excepthook"]  # adopted, not owned: whoever started it reports failures
        state.destroy_process_group()
        assert _leftovers() == CLEAN
        reset_state()


NOTEBOOK = textwrap.dedent("""
    import json, sys, threading
    import torch.distributed as dist
    from hasten import notebook_launcher
    from hasten.runtime import process_group

    def train():
        from hasten import Accelerator
        import torch
        accelerator = Accelerator(cpu=True)
        model = accelerator.prepare(torch.nn.Linear(2, 2))
        accelerator.backward(model(torch.ones(1, 2)).sum())
        assert any(t.name == "hasten-watchdog" for t in threading.enumerate())

    hook = sys.excepthook
    notebook_launcher(train, num_processes=2)
    print(json.dumps({"group": dist.is_initialized(),
                      "threads": [t.name for t in threading.enumerate() if t is not threading.main_thread()],
                      "hooks": len(process_group._BEFORE_END), "excepthook": sys.excepthook is not hook}))
""")


def test_notebook_launcher_leaves_nothing_in_the_notebook(tmp_path):
    script = tmp_path / "nb.py"
    script.write_text(NOTEBOOK)
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", TMPDIR=str(tmp_path))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == {"group": False, "threads": [], "hooks": 0, "excepthook": False}


LAUNCHED = textwrap.dedent("""
    import atexit, json, os, sys, threading
    registered = []
    _register = atexit.register
    def counting(fn, *args, **kwargs):
        if (getattr(fn, "__module__", None) or "").startswith("hasten"):
            registered.append(fn.__qualname__)
        return _register(fn, *args, **kwargs)
    atexit.register = counting
    ours = lambda: "_record_then_report" in getattr(sys.excepthook, "__qualname__", "")

    import torch
    import torch.distributed as dist
    from hasten import Accelerator
    from hasten.runtime import process_group
    from hasten.runtime.debug_checks import debug_checks_enabled

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    accelerator = Accelerator(cpu=True)
    if attempt == 0 and accelerator.process_index == 1:
        raise SystemExit("first attempt fails on purpose: the agent restarts the worker group")
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    accelerator.backward(model(torch.ones(1, 2)).sum())
    during = {"watchdog": any(t.name == "hasten-watchdog" for t in threading.enumerate()),
              "excepthook": ours(), "hooks": len(process_group._BEFORE_END)}
    accelerator.end_training()
    after = {"group": dist.is_initialized(), "watchdog": any(t.name == "hasten-watchdog" for t in threading.enumerate()),
             "hooks": len(process_group._BEFORE_END), "debug": debug_checks_enabled(),
             "excepthook": ours(), "atexit": registered}
    with open(f"report{accelerator.process_index}.json", "w") as f:
        json.dump({"attempt": attempt, "during": during, "after": after}, f)
""")


@pytest.mark.launch
def test_launched_run_with_an_elastic_restart_leaves_nothing(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(LAUNCHED)
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", HASTEN_HOME=str(tmp_path / "home"),
               TMPDIR=str(tmp_path))
    env.pop("HASTEN_LAUNCH_CONFIG", None)
    proc = subprocess.run([sys.executable, "-m", "hasten.commands.main", "launch", "--cpu", "--num_processes", "2",
                           "--max_restarts", "1", str(script)], capture_output=True, text=True, timeout=240, env=env,
                          cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    reports = [json.loads((tmp_path / f"report{rank}.json").read_text()) for rank in (0, 1)]
    assert {r["attempt"] for r in reports} == {1}, out
    for report in reports:
        assert report["during"] == {"watchdog": True, "excepthook": True, "hooks": 1}, report
        assert report["after"] == {"group": False, "watchdog": False, "hooks": 0, "debug": False,
                                   "excepthook": False, "atexit": ["end_group"]}, report
