"""The architecture's rules, checked on the source: layering, environment access, file budget, lazy imports."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "hasten"

# Lower index = lower layer. A module may import only from its own layer or below, wherever the import
# statement is (module level or inside a function); only `if TYPE_CHECKING:` blocks are exempt.
LAYERS = [
    ["hasten.exceptions", "hasten._lazy", "hasten._accelerate_alias", "hasten._accelerate_paths", "hasten._private_api",
     "hasten._accelerate_shown", "hasten.base"],
    ["hasten.config", "hasten.parallelism_config"],
    ["hasten.precision", "hasten.environments", "hasten.runtime", "hasten.devices", "hasten.ops"],
    ["hasten.checkpointing"],
    ["hasten.strategies"],
    ["hasten.connector"],
    ["hasten.state", "hasten.logging"],
    ["hasten.data", "hasten.optim", "hasten.tracking", "hasten.optimizer", "hasten.scheduler", "hasten.state_helpers",
     "hasten.accelerator_state_files", "hasten.fault_tolerance"],
    ["hasten.accelerator", "hasten.launchers", "hasten.big_modeling", "hasten.local_sgd", "hasten.data_loader",
     "hasten.hooks", "hasten.inference", "hasten.memory_plan"],
    ["hasten.commands", "hasten.testing", "hasten.test_utils", "hasten.memory_utils", "hasten.integrations"],
    # Accelerate's `accelerate.utils` namespace: aliases of the ground floor's modules (hasten.base) and
    # Accelerate-only paths. Nothing inside hasten imports it (the facade rule below resolves its names).
    ["hasten.utils"],
]
# Accelerate-compatible re-export facades resolve their names lazily, from every layer: `hasten`,
# `hasten.utils`, `hasten.utils.operations`, and the two `accelerate.utils.<module>` paths whose names
# live higher up (`tqdm` in hasten.logging, `wait_for_everyone` in hasten.state).
FACADES = {"hasten", "hasten.utils", "hasten.utils.operations", "hasten.utils.tqdm", "hasten.utils.other",
           "hasten.utils.fsdp_utils"}
# No import runs upward, not even inside a function: this set stays empty (a pair here would be a
# (module, imported) exception with its reason, to be moved down before the next release).
UPWARD_ALLOWED: set[tuple[str, str]] = set()
# Accelerate's module paths that show names hasten defines on a higher floor (``hasten/_accelerate_paths.py``'s
# ``PATHS``; each face's ``__getattr__`` imports a routed name from its one definition on first use). They exist
# because ``accelerate.X`` *is* ``hasten.X`` (the ``sys.modules`` alias), so the ground module must show what
# Accelerate's shows. No hasten module takes a routed name through a face (checked below), so these routes serve
# user code only; a new face that climbs needs its reason here.
ACCELERATE_PATH_FACES = {
    "hasten.base.dataclasses": "accelerate.utils.dataclasses holds the DeepSpeed/FSDP plugins and the TP/CP "
                               "configs (config/) and TensorInformation (ops/)",
    "hasten.base.deepspeed": "accelerate.utils.deepspeed holds the engine and optimizer/scheduler wrappers "
                             "(strategies/, optim) and the plugin's helpers (config/)",
    "hasten.base.imports": "accelerate.utils.imports holds deepspeed_required, a decorator over the state "
                           "(state_helpers)",
    "hasten.base.modeling": "accelerate.utils.modeling holds device maps, offload and dtype sizes (big_modeling/)",
    "hasten.checkpointing": "accelerate.checkpointing holds save/load_accelerator_state and save_custom_state",
}
ENV_ALLOWED = ("config/env.py", "environments/", "base/environment.py", "launchers/", "commands/", "testing/",
               "test_utils/",
               "strategies/deepspeed.py", "base/deepspeed_runtime.py",
               "runtime/process_group.py", "runtime/preemption.py")  # rendezvous variables; SLURM's requeue


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _layer(module: str) -> int | None:
    for index, names in enumerate(LAYERS):
        if any(module == n or module.startswith(n + ".") for n in names):
            return index
    return None


def _sources():
    return sorted(SRC.rglob("*.py"))


def _is_type_checking_block(node: ast.AST) -> bool:
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(node: ast.AST, package: str):
    """Every imported module name under ``node`` (functions and methods included), with its line."""
    for child in ast.iter_child_nodes(node):
        if _is_type_checking_block(child):
            yield from (found for stmt in child.orelse for found in _imports(ast.Module([stmt], []), package))
            continue
        if isinstance(child, ast.Import):
            yield from ((alias.name, child.lineno) for alias in child.names)
        elif isinstance(child, ast.ImportFrom):
            if child.level:  # relative: resolve against this module's package
                base = package.split(".")[: len(package.split(".")) - child.level + 1]
                yield ".".join(base + ([child.module] if child.module else [])), child.lineno
            elif child.module:
                yield child.module, child.lineno
        yield from _imports(child, package)


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(SRC)))
def test_layering(path):
    module = _module_name(path)
    if module in FACADES:
        return
    mine = _layer(module)
    assert mine is not None, f"{module} is in no layer of the architecture: add it to LAYERS"
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for imported, line in _imports(ast.parse(path.read_text()), package):
        if not imported.startswith("hasten"):
            continue
        theirs = _layer(imported) if imported not in FACADES else 0
        if (module, imported) in UPWARD_ALLOWED:
            continue
        assert theirs is not None and theirs <= mine, (
            f"{module}:{line} (layer {mine}) imports {imported} (layer {theirs})")


def test_layer_walk_sees_function_level_imports():
    """The walk must see imports inside functions and skip only TYPE_CHECKING blocks."""
    code = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import hasten.state\n"
            "def f():\n    from hasten.accelerator import Accelerator\n")
    names = [name for name, _ in _imports(ast.parse(code), "hasten.utils")]
    assert names == ["typing", "hasten.accelerator"]


def _module_imports(module: str, code: str, known: set[str], exports: dict[str, dict[str, str]]) -> set[str]:
    """The modules ``module`` imports, anywhere (module level, functions, ``TYPE_CHECKING`` blocks).

    ``from facade import name`` points at the module that defines ``name`` (the facade's lazy table), and
    a facade (a module with a module-level ``__getattr__``) points at every module its code names in a
    string: the ones it imports lazily.
    """
    tree = ast.parse(code)
    is_package = module in {m.rpartition(".")[0] for m in known if "." in m}
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                if f"{base}.{alias.name}" in known:
                    found.add(f"{base}.{alias.name}")
                else:
                    found.add(exports.get(base, {}).get(alias.name, base))
    if any(isinstance(node, ast.FunctionDef) and node.name == "__getattr__" for node in tree.body) or any(
            isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__getattr__" for t in node.targets)
            for node in tree.body):
        found.update(node.value for node in ast.walk(tree)
                     if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in known)
    return {name for name in found if name in known and name != module}


def _import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def _facade_exports(known: set[str]) -> dict[str, dict[str, str]]:
    import importlib

    tables = {}
    for name in ("hasten", "hasten.utils", "hasten.utils.operations", "hasten.launchers"):
        tables[name] = dict(importlib.import_module(name)._EXPORTS)
    for face, routes in importlib.import_module("hasten._accelerate_paths").PATHS.items():
        tables.setdefault(face, {}).update(routes)  # Accelerate's path table: a name's route from its face
    return tables


def test_no_import_circle():
    """No module reaches itself again through imports of any kind, the facades' lazy ones included."""
    sources = {_module_name(path): path.read_text() for path in _sources()}
    known = set(sources)
    exports = _facade_exports(known)
    graph = {module: _module_imports(module, code, known, exports) for module, code in sources.items()}
    circles = _import_circles(graph)
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


def test_accelerate_path_routes_are_counted():
    """Accelerate's path table routes names from a face to their definition, upward only from the declared
    faces, and no hasten module takes a routed name through a face (an import that would climb unseen by
    ``test_layering``, which reads module names only)."""
    from hasten._accelerate_paths import PATHS

    climbing = {face for face, routes in PATHS.items()
                if any(_layer(target) > _layer(face) for target in routes.values())}
    assert climbing == set(ACCELERATE_PATH_FACES), "faces whose routes climb: declare each in ACCELERATE_PATH_FACES"
    through_face = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in PATHS:
                through_face += [f"{_module_name(path)}:{node.lineno} takes {alias.name} through {node.module}"
                                 for alias in node.names if alias.name in PATHS[node.module]]
    assert not through_face, through_face


def test_circle_finder_sees_every_kind_of_import():
    """A circle closed inside a function, by a type-only import, or through a facade's lazy table is found."""
    known = {"pkg", "pkg.low", "pkg.high", "pkg.facade", "pkg.typed"}
    exports = {"pkg.facade": {"High": "pkg.high"}}
    function_level = {"pkg.low": "def f():\n    from pkg.high import x\n", "pkg.high": "import pkg.low\n"}
    type_only = {"pkg.typed": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high import H\n",
                 "pkg.high": "from pkg import typed\n"}
    through_facade = {"pkg.low": "from pkg.facade import High\n", "pkg.high": "from pkg.low import y\n",
                      "pkg.facade": "def __getattr__(name):\n    import importlib\n    "
                                    "return importlib.import_module('pkg.high')\n"}
    for case in (function_level, type_only, through_facade):
        graph = {module: _module_imports(module, code, known, exports) for module, code in case.items()}
        assert _import_circles(graph), case
    harmless = {"pkg.low": "import os\n", "pkg.high": "from pkg.low import y\nfrom pkg.facade import High\n"}
    graph = {module: _module_imports(module, code, known, exports) for module, code in harmless.items()}
    assert _import_circles(graph) == []


def test_environment_read_only_in_allowed_modules():
    offenders = []
    for path in _sources():
        rel = str(path.relative_to(SRC))
        if rel.startswith(ENV_ALLOWED):
            continue
        if "os.environ" in path.read_text() or "getenv(" in path.read_text():
            offenders.append(rel)
    assert not offenders, f"os.environ outside the allowed modules: {offenders}"


def test_private_apis_only_in_one_module():
    """Private torch/CPython/pytest names appear only in hasten/_private_api.py, where each is guarded."""
    from hasten._private_api import PRIVATE_NAMES

    offenders = {}
    for path in _sources():
        if path.name == "_private_api.py":
            continue
        code = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
        found = [name for name in PRIVATE_NAMES if name in code]
        if found:
            offenders[str(path.relative_to(SRC))] = found
    assert not offenders, f"private APIs outside hasten/_private_api.py: {offenders}"


# Calls that change a container or start a thread: on a module-level name they make the module stateful.
_MUTATING_CALLS = {"add", "append", "appendleft", "clear", "discard", "extend", "insert", "pop", "popitem", "popleft",
                   "remove", "reverse", "setdefault", "sort", "start", "update"}


def _module_state(code: str) -> list[str]:
    """What makes a module stateful: a thread import, a ``global`` statement, a module-level instance of a
    class it defines, or a module-level name written through an item, an attribute or a mutating call
    anywhere in it. Constant tables (a dict nobody writes) are fine."""
    tree = ast.parse(code)
    found: list[str] = []
    names: set[str] = set()
    classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
            value = node.value
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in classes:
                found.append(f"line {node.lineno}: module-level instance of {value.func.id}")

    def _base(node: ast.AST) -> str | None:
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(m.split(".")[0] in ("threading", "_thread") for m in modules):
                found.append(f"line {node.lineno}: imports threading")
        elif isinstance(node, ast.Global):
            found.append(f"line {node.lineno}: global {', '.join(node.names)}")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = (node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target])
            for target in targets:
                if isinstance(target, (ast.Attribute, ast.Subscript)) and _base(target) in names:
                    found.append(f"line {node.lineno}: writes module-level {_base(target)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in _MUTATING_CALLS and _base(node.func.value) in names):
            found.append(f"line {node.lineno}: {_base(node.func.value)}.{node.func.attr}(...) changes module state")
    return found


@pytest.mark.parametrize("package", ["ops", "environments"])
def test_package_holds_no_module_state_and_starts_no_thread(package):
    """``ops/`` and ``environments/`` are stateless (collectives; detection from an env mapping): what
    hangs on the process group (the watchdog, debug checks, preemption) lives in ``runtime/`` beside
    ``process_group.py``, which owns the group's lifetime."""
    problems = {str(path.relative_to(SRC)): found for path in sorted((SRC / package).rglob("*.py"))
                if (found := _module_state(path.read_text()))}
    assert problems == {}


def test_module_state_finder_sees_every_kind():
    code = ("import threading\nfrom collections import deque\nTABLE = {1: 2}\nSEEN = {}\nRECENT = deque()\n"
            "class _Slot:\n    pass\nSLOT = _Slot()\n"
            "def f(x):\n    global COUNT\n    SEEN[x] = 1\n    SLOT.value = x\n    RECENT.append(x)\n"
            "    return TABLE.get(x)\n")
    found = " | ".join(_module_state(code))
    for kind in ("imports threading", "instance of _Slot", "global COUNT", "writes module-level SEEN",
                 "writes module-level SLOT", "RECENT.append"):
        assert kind in found, (kind, found)
    assert "TABLE" not in found  # a constant table nobody writes is not state
    assert _module_state("TABLE = {1: 2}\ndef f(x):\n    local = {}\n    local[x] = TABLE[x]\n") == []


def test_one_mesh_builder():
    """Only ``ParallelismConfig.build_device_mesh`` creates a ``DeviceMesh`` (docs/architecture.md, N-D parallelism)."""
    builders = sorted(str(path.relative_to(SRC)) for path in _sources()
                      if re.search(r"\binit_device_mesh\b|\bDeviceMesh\(\s*[^)\s]", path.read_text()))
    assert builders == ["config/parallelism.py"]


def test_file_budget():
    too_long = {str(p.relative_to(SRC)): n for p in _sources() if (n := len(p.read_text().splitlines())) > 600}
    assert not too_long, f"files over 600 lines: {too_long}"


#: Parts of torch that hasten must not import unless a run uses them: each is seconds of CPU per process,
#: paid by every rank of every launch (torch._dynamo alone ~2 CPU-s; it imports torch.distributed.fsdp).
#: torch itself imports none of them; torch's optimizers and DDP import torch._dynamo.
HEAVY_TORCH = ("torch._dynamo", "torch._inductor", "torch.distributed.fsdp", "torch.distributed.tensor",
               "torch.distributed.checkpoint", "torch.distributed.elastic", "safetensors", "yaml")


def test_import_is_light():
    """``import hasten`` loads no heavy library; a one-process run that prepares a model (no optimizer),
    unwraps it, reads its state dict and ends loads none of the heavy parts of torch either."""
    code = ("import sys, hasten; from hasten import Accelerator; "
            "heavy = [m for m in ('deepspeed', 'tensorboard', 'mlflow', 'wandb', 'transformers', 'accelerate') "
            "if m in sys.modules]; print(heavy); "
            "import torch; accelerator = Accelerator(cpu=True); model = accelerator.prepare(torch.nn.Linear(2, 2)); "
            "accelerator.unwrap_model(model); accelerator.get_state_dict(model); accelerator.end_training(); "
            f"print([m for m in {HEAVY_TORCH!r} if m in sys.modules])")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         env=env)
    assert out.stdout.split() == ["[]", "[]"], out.stdout


@pytest.mark.parametrize("facade", ["hasten", "hasten.utils", "hasten.utils.operations", "hasten.launchers"])
def test_type_checkers_see_every_lazy_export(facade):
    """A facade's TYPE_CHECKING imports name exactly its lazy exports, from the same modules."""
    import importlib

    path = SRC.joinpath(*facade.split(".")[1:])
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    tree = ast.parse(path.read_text())
    block = next(node for node in tree.body if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING")
    typed = {alias.asname or alias.name: node.module for node in block.body if isinstance(node, ast.ImportFrom)
             for alias in node.names}
    assert typed == importlib.import_module(facade)._EXPORTS
    assert all(alias.asname == alias.name for node in block.body for alias in node.names)  # explicit re-exports


def test_accelerate_utils_modules_are_the_ground_floor_modules_themselves():
    """``hasten.utils.<m>`` is an alias of ``hasten.base.<m>``: one module object, so patching either patches both."""
    import importlib

    aliases = [p.stem for p in (SRC / "utils").glob("*.py") if p.stem != "__init__" and (SRC / "base" / p.name).exists()]
    assert {"dataclasses", "environment", "imports", "modeling", "memory"} <= set(aliases)
    for name in aliases:
        assert importlib.import_module(f"hasten.utils.{name}") is importlib.import_module(f"hasten.base.{name}"), name
    from hasten.utils.dataclasses import DistributedType

    assert DistributedType.__module__ == "hasten.base.dataclasses"
    # Accelerate's names that hasten defines higher up still resolve at the Accelerate path.
    from hasten.utils import modeling

    assert callable(modeling.load_checkpoint_in_model)
