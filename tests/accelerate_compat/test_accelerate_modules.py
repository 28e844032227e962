"""Every module of Accelerate 1.15 exists at the same path under hasten, with the public names it defines;
constants, enum members, class attributes and dataclass defaults have Accelerate's values.

The table is the ``modules`` part of tests/fixtures/accelerate_inventory.json, written by
tools/accelerate_inventory.py from an installed Accelerate. A value recorded as ``null`` is not plain data
(an object, a function): only its presence is checked. ``DIFFERENT_ON_PURPOSE`` lists the values hasten
keeps different, each with the reason (docs/migrating.md repeats them).
"""

from __future__ import annotations

import enum
import importlib
import inspect
import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from accelerate_inventory import _data  # noqa: E402  (the one conversion of a value to data, shared)

TABLE = json.loads((Path(__file__).parents[1] / "fixtures" / "accelerate_inventory.json").read_text())
MODULES: dict[str, dict[str, Any]] = TABLE["modules"]
_TRACKER_WHERE = ("Accelerate marks it False but starts the tracker on the main process only; in hasten the flag "
                  "decides where a tracker lives, so one run per job means True (hasten/tracking/_wandb.py)")
DIFFERENT_ON_PURPOSE: dict[tuple[str, str], str] = {
    ("hasten.tracking.WandBTracker", "main_process_only"): _TRACKER_WHERE,
    ("hasten.tracking.SwanLabTracker", "main_process_only"): _TRACKER_WHERE,
    ("hasten.tracking.TrackioTracker", "main_process_only"): _TRACKER_WHERE,
    ("hasten.test_utils.testing", "DEFAULT_LAUNCH_COMMAND"): "`hasten launch ...` where Accelerate's is "
                                                             "`accelerate launch ...` (same options)",
    ("hasten.commands.merge", "description"): "help text: hasten's describes its FSDP2 (DCP) merge",
}
# Classes hasten refuses (tests/accelerate_compat/test_accelerate_inventory.py's ``refused`` rows): their defaults are moot.
REFUSED = {row["name"] for row in TABLE["names"] if row.get("refused") and "." not in row["name"]}


def same_data(actual: Any, expected: Any) -> bool:
    """``actual`` equals Accelerate's ``expected``; a mapping may hold more keys (hasten's additions)."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        return all(key in actual and same_data(actual[key], value) for key, value in expected.items())
    return actual == expected


def hasten_path(module: str) -> str:
    return "hasten" + module[len("accelerate"):]


def _class_problems(where: str, cls: type, entry: dict[str, Any]) -> list[str]:
    if entry["kind"] == "enum":
        if not issubclass(cls, enum.Enum):
            return [f"{where} is not an Enum"]
        members = {m.name: _data(m.value) for m in cls}
        return [f"{where}.{name}: {members.get(name, '<missing>')!r}, Accelerate's is {value!r}"
                for name, value in entry["members"].items() if members.get(name, "<missing>") != value]
    problems: list[str] = []
    if cls.__name__ in REFUSED:
        return problems
    fields = getattr(cls, "__dataclass_fields__", {})
    for name, value in entry["attributes"].items():
        if (where, name) in DIFFERENT_ON_PURPOSE:
            continue
        if name in fields:
            default = fields[name].default
            actual = None if default is inspect.Parameter.empty else _data(default)
            if repr(default) == "<dataclasses._MISSING_TYPE object>":
                actual = "<no default>"
        elif hasattr(cls, name):
            actual = _data(getattr(cls, name))
        else:
            problems.append(f"{where}.{name} is missing")
            continue
        if value is not None and not same_data(actual, value):
            problems.append(f"{where}.{name} = {actual!r}, Accelerate's is {value!r}")
    return problems


def module_problems(module_name: str) -> list[str]:
    """What hasten's module at Accelerate's path lacks or has different; empty when it matches."""
    path = hasten_path(module_name)
    try:
        module = importlib.import_module(path)
    except ImportError as error:
        return [f"no module {path} ({error})"]
    problems = []
    for name, entry in MODULES[module_name].items():
        where = f"{path}.{name}"
        if not hasattr(module, name):
            problems.append(f"{where} is missing")
            continue
        obj = getattr(module, name)
        if entry["kind"] in ("class", "enum"):
            if not inspect.isclass(obj):
                problems.append(f"{where} is not a class")
            else:
                problems += _class_problems(where, obj, entry)
        elif entry["kind"] == "function" and not callable(obj):
            problems.append(f"{where} is not callable")
        elif entry["kind"] == "constant" and entry["value"] is not None and (path, name) not in DIFFERENT_ON_PURPOSE:
            if not same_data(_data(obj), entry["value"]):
                problems.append(f"{where} = {_data(obj)!r}, Accelerate's is {entry['value']!r}")
    return problems


@pytest.mark.parametrize("module_name", sorted(MODULES))
def test_module_matches_accelerate(module_name):
    problems = module_problems(module_name)
    assert not problems, "\n".join(problems)


def test_table_covers_modules_and_constants():
    assert len(MODULES) > 55
    assert MODULES["accelerate.utils.constants"]["FSDP_AUTO_WRAP_POLICY"]["value"] == [
        "TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"]
    assert MODULES["accelerate.utils.dataclasses"]["DistributedType"]["members"]["MULTI_CPU"] == "MULTI_CPU"


def _accelerate_path_modules() -> list[str]:
    """Every hasten module at one of Accelerate's paths: the inventory's and the path table's."""
    from hasten._accelerate_paths import PATHS

    return sorted({hasten_path(m) for m in MODULES} | set(PATHS))


@pytest.mark.parametrize("module_name", _accelerate_path_modules())
def test_a_missing_name_is_an_attribute_error(module_name):
    # Other libraries detect features with hasattr() / getattr(module, name, default): a module __getattr__
    # that raises anything but AttributeError (ModuleNotFoundError from a submodule probe, say) breaks them.
    module = importlib.import_module(module_name)
    assert hasattr(module, "no_such_name") is False
    assert getattr(module, "no_such_name", 7) == 7
    with pytest.raises(AttributeError, match="no_such_name"):
        module.no_such_name  # noqa: B018


def test_distributed_type_tpu_is_the_deprecated_name_of_xla():
    from hasten.utils import DistributedType

    with pytest.warns(FutureWarning, match="DistributedType.TPU is deprecated.*DistributedType.XLA"):
        assert DistributedType.TPU is DistributedType.XLA
    with pytest.warns(FutureWarning):
        assert DistributedType["TPU"] is DistributedType.XLA
    # Accelerate 1.x's members, unchanged: the old name is not a member of its own
    assert "TPU" not in DistributedType.__members__ and "TPU" not in [m.name for m in DistributedType]
    assert DistributedType("XLA") is DistributedType.XLA
    with pytest.raises(AttributeError):
        DistributedType.NO_SUCH_MEMBER  # noqa: B018


if __name__ == "__main__":  # a summary: every module and name that does not match yet
    for name in sorted(MODULES):
        for problem in module_problems(name):
            print(problem)
