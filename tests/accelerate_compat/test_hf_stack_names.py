"""Every Accelerate name that Transformers, TRL, PEFT and diffusers use exists in hasten at the same path.

The table (``tests/fixtures/hf_stack_names.json``) is written by ``tools/hf_stack_scan.py`` from those
packages' installed sources: imports, ``accelerate.x.y`` chains, ``accelerator.<attr>`` and
``accelerator.state.<attr>`` reads, and keyword arguments of calls to Accelerate's names.
"""

import importlib
import inspect
import json
from pathlib import Path

import pytest

TABLE = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "hf_stack_names.json").read_text())
ROWS = [row for row in TABLE["names"] if not row.get("not_accelerate")]


def _hasten_path(module: str) -> str:
    return "hasten" + module[len("accelerate"):]


def _row_id(row):
    return f"{row['kind']}:{row['module']}:{row['name']}"


@pytest.fixture
def accelerator():
    from hasten import Accelerator

    return Accelerator(cpu=True)  # the test plugin resets the shared state around each test


def _has_attribute(obj, name):
    return hasattr(type(obj), name) or name in vars(obj) or hasattr(obj, name)


def test_table_covers_the_four_packages():
    assert set(TABLE["packages"]) == {"transformers", "trl", "peft", "diffusers"}
    assert len(ROWS) > 100
    assert all(row["used_by"] for row in ROWS)


@pytest.mark.parametrize("row", [r for r in ROWS if r["kind"] in ("import", "attribute")], ids=_row_id)
def test_module_names_exist(row):
    if row["module"] == "accelerate" and row["name"] == "__version__":
        from hasten._accelerate_alias import ACCELERATE_VERSION

        assert ACCELERATE_VERSION
        return
    module = importlib.import_module(_hasten_path(row["module"]))
    if row["name"] is not None:
        value = getattr(module, row["name"])
        refused = (getattr(value, "__doc__", None) or "").startswith("Not supported by hasten")
        assert not refused or row.get("refused"), (
            f"{row['module']}.{row['name']} is a refusal stub in hasten but {row['used_by']} use it")


@pytest.mark.parametrize("row", [r for r in ROWS if r["kind"] in ("accelerator", "state")], ids=_row_id)
def test_accelerator_attributes_exist(row, accelerator):
    obj = accelerator if row["kind"] == "accelerator" else accelerator.state
    assert _has_attribute(obj, row["name"]), f"{type(obj).__name__}.{row['name']} (used by {row['used_by']})"


@pytest.mark.parametrize("row", [r for r in ROWS if r["kind"] == "keyword"], ids=_row_id)
def test_keyword_arguments_are_accepted(row):
    callee, _, keyword = row["name"].partition(".")
    target = getattr(importlib.import_module(_hasten_path(row["module"])), callee)
    parameters = inspect.signature(target).parameters
    assert keyword in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values()), (
        f"{callee}({keyword}=...) used by {row['used_by']}")
