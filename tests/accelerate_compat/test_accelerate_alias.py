"""``hasten.install_as_accelerate()``: ``import accelerate`` gives hasten's own modules, in a fresh interpreter."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INVENTORY = ROOT / "tests" / "fixtures" / "accelerate_inventory.json"


def _python(code, tmp_path, executable=sys.executable):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    out = subprocess.run([executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=180,
                         cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_mirrored_version_is_the_inventorys():
    from hasten._accelerate_alias import ACCELERATE_VERSION

    assert ACCELERATE_VERSION == json.loads(INVENTORY.read_text())["accelerate_version"]


def test_accelerate_resolves_to_hastens_own_modules(tmp_path):
    out = _python("""
        import importlib.metadata, importlib.util, sys, hasten
        assert "accelerate" not in sys.modules
        hasten.install_as_accelerate()
        hasten.install_as_accelerate()  # twice: nothing more
        assert sum(type(f).__name__ == "AccelerateAliasFinder" for f in sys.meta_path) == 1
        import accelerate, accelerate.utils, accelerate.utils.operations, hasten.utils, hasten.utils.operations
        from accelerate import Accelerator
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType
        import hasten.state
        assert accelerate.utils is hasten.utils and accelerate.state is hasten.state
        assert accelerate.utils.operations is hasten.utils.operations
        assert Accelerator is hasten.Accelerator and PartialState is hasten.state.PartialState
        assert DistributedType is hasten.utils.DistributedType
        # hasten's modules keep their own identity for relative imports and reloads
        assert hasten.utils.__name__ == "hasten.utils" and hasten.utils.__spec__.name == "hasten.utils"
        # submodules are attributes without an import, as after Accelerate's eager __init__
        assert accelerate.big_modeling is sys.modules["hasten.big_modeling"]
        assert accelerate.utils.modeling is sys.modules["hasten.utils.modeling"]
        assert accelerate.__version__ == importlib.metadata.version("accelerate") == "1.15.0"
        assert importlib.util.find_spec("accelerate") is not None
        try:
            from accelerate.utils import no_such_name
        except ImportError as exc:
            print("import-error", exc.name)
        try:
            import accelerate.no_such_module
        except ModuleNotFoundError as exc:
            print("module-not-found", exc.name)
        try:
            accelerate.no_such_name
        except AttributeError as exc:
            print("attribute-error", exc)
        hasten.uninstall_as_accelerate()
        assert "accelerate" not in sys.modules and "accelerate.utils" not in sys.modules
        try:
            importlib.metadata.version("accelerate")
        except importlib.metadata.PackageNotFoundError:
            print("undone")
        """, tmp_path)
    assert out.split("\n")[:4] == ["import-error hasten.utils", "module-not-found accelerate.no_such_module",
                                   "attribute-error module 'accelerate' has no attribute 'no_such_name'", "undone"]


def test_transformers_sees_it_as_accelerate(tmp_path):
    pytest.importorskip("transformers")
    out = _python("""
        import hasten
        hasten.install_as_accelerate()
        from transformers.utils import is_accelerate_available
        from transformers import Trainer, TrainingArguments
        import transformers.trainer as trainer_module
        print(is_accelerate_available(), trainer_module.Accelerator is hasten.Accelerator)
        """, tmp_path)
    assert out.split() == ["True", "True"]


def test_refuses_when_the_real_accelerate_is_imported(tmp_path):
    out = _python("""
        import sys, types, hasten
        sys.modules["accelerate"] = types.ModuleType("accelerate")  # what `import accelerate` leaves
        try:
            hasten.install_as_accelerate()
        except ImportError as exc:
            print(exc)
        from hasten._accelerate_alias import install_unless_real_accelerate
        print(install_unless_real_accelerate())
        """, tmp_path)
    assert "the real accelerate is already imported" in out and "call hasten.install_as_accelerate() first" in out
    assert out.split()[-1] == "False"


def test_import_hasten_does_not_install_it(tmp_path):
    out = _python("import sys, hasten; hasten.Accelerator; print([m for m in sys.modules if 'accelerate' in m "
                  "and not m.startswith('hasten')])", tmp_path)
    assert out.strip() == "[]"


def test_debug_launcher_installs_it_in_every_rank(tmp_path):
    out = _python("""
        import sys
        from hasten import debug_launcher
        def check():
            import accelerate, hasten.state
            assert accelerate.state is hasten.state
            assert accelerate.PartialState().num_processes == 2
        debug_launcher(check, num_processes=2)
        print("parent-untouched", "accelerate" not in sys.modules)
        """, tmp_path)
    assert "parent-untouched True" in out


def test_a_folder_named_accelerate_does_not_stop_the_alias(tmp_path):
    # ./accelerate/fsdp.yaml (a config folder) imports as an empty namespace package: not Accelerate.
    (tmp_path / "accelerate").mkdir()
    (tmp_path / "accelerate" / "fsdp.yaml").write_text("distributed_type: FSDP\n")
    out = _python("""
        import sys, hasten
        from hasten._accelerate_alias import install_unless_real_accelerate, real_accelerate_installed
        print("real", real_accelerate_installed())
        print("installed", install_unless_real_accelerate())
        import accelerate
        print("hasten", accelerate.Accelerator is hasten.Accelerator)
        hasten.uninstall_as_accelerate()
        import accelerate  # the folder again, imported before install_as_accelerate: hasten takes the name
        print("namespace", accelerate.__spec__.origin)
        hasten.install_as_accelerate()
        import accelerate.utils
        print("hasten-after", accelerate.utils is hasten.utils)
        """, tmp_path)
    assert out.split("\n")[:5] == ["real False", "installed True", "hasten True", "namespace None",
                                   "hasten-after True"]


def test_a_regular_package_named_accelerate_is_still_respected(tmp_path):
    (tmp_path / "accelerate").mkdir()
    (tmp_path / "accelerate" / "__init__.py").write_text("MINE = True\n")
    out = _python("""
        from hasten._accelerate_alias import install_unless_real_accelerate
        print(install_unless_real_accelerate())
        import accelerate
        print(accelerate.MINE)
        """, tmp_path)
    assert out.split() == ["False", "True"]


@pytest.mark.launch
def test_hasten_launch_workers_get_the_alias_beside_an_accelerate_folder(tmp_path):
    (tmp_path / "accelerate").mkdir()
    (tmp_path / "accelerate" / "fsdp.yaml").write_text("distributed_type: FSDP\n")
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import accelerate, hasten
        from accelerate import PartialState
        assert accelerate.utils is hasten.utils, accelerate
        state = PartialState()
        with open(f"rank{state.process_index}.txt", "w") as out:  # a file each: printed lines may interleave
            out.write(f"rank {state.process_index} alias {accelerate.__version__}")
        """))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"), HASTEN_HOME=str(tmp_path / "home"))
    out = subprocess.run([sys.executable, "-m", "hasten.commands.main", "launch", "--cpu", "--num_processes", "2",
                          "train.py"], capture_output=True, text=True, timeout=180, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert [(tmp_path / f"rank{rank}.txt").read_text() for rank in (0, 1)] == [
        "rank 0 alias 1.15.0", "rank 1 alias 1.15.0"]
