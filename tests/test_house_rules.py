"""The architecture's rules, checked on the source: layering, environment access, file budget, lazy imports."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "hasten"

# Lower index = lower layer. A module may import (at module level) only from its own layer or below.
LAYERS = [
    ["hasten.exceptions", "hasten.utils"],
    ["hasten.config", "hasten.parallelism_config"],
    ["hasten.precision", "hasten.environments", "hasten.devices", "hasten.ops"],
    ["hasten.strategies"],
    ["hasten.connector"],
    ["hasten.state", "hasten.logging"],
    ["hasten.data", "hasten.checkpointing", "hasten.optim", "hasten.tracking", "hasten.optimizer",
     "hasten.scheduler"],
    ["hasten.accelerator", "hasten.launchers", "hasten.big_modeling", "hasten.local_sgd", "hasten.data_loader",
     "hasten.hooks", "hasten.inference"],
    ["hasten.commands", "hasten.testing", "hasten.test_utils"],
]
# Accelerate-compatible re-export facades resolve their names lazily, from every layer.
FACADES = {"hasten", "hasten.utils", "hasten.utils.operations"}
ENV_ALLOWED = ("config/env.py", "environments/", "utils/environment.py", "launchers/", "commands/", "testing/",
               "strategies/deepspeed.py")


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


def _module_level_imports(tree: ast.Module):
    for node in tree.body:  # `if TYPE_CHECKING:` blocks are not module-level imports
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(SRC)))
def test_layering(path):
    module = _module_name(path)
    if module in FACADES:
        return
    mine = _layer(module)
    assert mine is not None, f"{module} is in no layer of the architecture: add it to LAYERS"
    for imported in _module_level_imports(ast.parse(path.read_text())):
        if not imported.startswith("hasten"):
            continue
        theirs = _layer(imported) if imported not in FACADES else 0
        assert theirs is not None and theirs <= mine, f"{module} (layer {mine}) imports {imported} (layer {theirs})"


def test_environment_read_only_in_allowed_modules():
    offenders = []
    for path in _sources():
        rel = str(path.relative_to(SRC))
        if rel.startswith(ENV_ALLOWED):
            continue
        if "os.environ" in path.read_text() or "getenv(" in path.read_text():
            offenders.append(rel)
    assert not offenders, f"os.environ outside the allowed modules: {offenders}"


def test_file_budget():
    too_long = {str(p.relative_to(SRC)): n for p in _sources() if (n := len(p.read_text().splitlines())) > 600}
    assert not too_long, f"files over 600 lines: {too_long}"


def test_import_is_light():
    code = ("import sys, hasten; from hasten import Accelerator; "
            "heavy = [m for m in ('deepspeed', 'tensorboard', 'mlflow', 'wandb', 'transformers', 'accelerate') "
            "if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
