"""Every public name of Accelerate (from the committed table) exists in hasten with the same parameter names.

The table, tests/fixtures/accelerate_inventory.json, is written by tools/accelerate_inventory.py from an
installed Accelerate. Rows marked ``refused`` are names that hasten keeps (same path, same parameters)
but that raise a ConfigurationError when used, because they belong to hardware or products hasten does
not support; tests/accelerate_compat/test_accelerate_long_tail.py checks that they do.
"""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path
from typing import Any

import pytest

TABLE = Path(__file__).parents[1] / "fixtures" / "accelerate_inventory.json"
ROWS: list[dict[str, Any]] = json.loads(TABLE.read_text())["names"]


def hasten_path(module: str) -> str:
    """Accelerate's module path -> hasten's."""
    return "hasten" + module[len("accelerate"):]


def _params(obj: Any, kind: str) -> list[str] | None:
    if kind in ("method", "classmethod"):
        names = list(inspect.signature(obj).parameters)
        return names[1:] if names and names[0] in ("self", "cls") else names
    if inspect.isclass(obj):
        init = obj.__init__
        if init is object.__init__:
            return []
        names = list(inspect.signature(init).parameters)
        return names[1:] if names[:1] == ["self"] else names
    try:
        return list(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        return None


def _kind_of(owner: type, attr: str) -> str:
    for klass in inspect.getmro(owner):
        if attr in vars(klass):
            raw = vars(klass)[attr]
            if isinstance(raw, staticmethod):
                return "staticmethod"
            if isinstance(raw, classmethod):
                return "classmethod"
            if isinstance(raw, property):
                return "property"
            return "method"
    return "attribute"


def check(row: dict[str, Any]) -> str | None:
    """None when hasten has the name as Accelerate does, else what differs."""
    path = hasten_path(row["module"])
    try:
        module = importlib.import_module(path)
    except ImportError as error:
        return f"no module {path} ({error})"
    head, _, member = row["name"].partition(".")
    if not hasattr(module, head):
        return f"{path}.{head} is missing"
    obj = getattr(module, head)
    kind = row["kind"]
    if member:
        if not inspect.isclass(obj):
            return f"{path}.{head} is not a class"
        actual_kind = _kind_of(obj, member)
        if actual_kind == "attribute" and not hasattr(obj, member):
            return f"{path}.{row['name']} is missing"
        if kind == "property":
            return None if actual_kind in ("property", "attribute") else f"{row['name']} is a {actual_kind}"
        if actual_kind != kind:
            return f"{path}.{row['name']} is a {actual_kind}, Accelerate's is a {kind}"
        obj = getattr(obj, member)
    elif kind == "constant" or row["params"] is None:
        return None
    if row["params"] is None:
        return None
    actual = _params(obj, kind)
    expected = row["params"]
    if actual is None or actual == expected or expected in (["kwargs"], ["args", "kwargs"]):
        return None  # Accelerate's own signature is a catch-all there (a decorator without functools.wraps)
    if row.get("refused") and actual in (["args", "kwargs"], []):
        return None
    if actual[:len(expected)] == expected and _extras_are_optional(obj, kind, actual[len(expected):]):
        return None  # hasten additions after Accelerate's parameters, all with defaults: callers are unaffected
    own_keywords = _hasten_only_keywords(obj, kind, actual, expected)
    if own_keywords and [name for name in actual if name not in own_keywords] == expected:
        return None  # hasten keyword-only options before a trailing **kwargs (save_state's async_save)
    return f"{path}.{row['name']} takes {actual}, Accelerate's takes {expected}"


def _extras_are_optional(obj: Any, kind: str, extra: list[str]) -> bool:
    target = obj.__init__ if inspect.isclass(obj) else obj
    parameters = inspect.signature(target).parameters
    return all(parameters[name].default is not inspect.Parameter.empty
               or parameters[name].kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
               for name in extra)


def _hasten_only_keywords(obj: Any, kind: str, actual: list[str], expected: list[str]) -> set[str]:
    target = obj.__init__ if inspect.isclass(obj) else obj
    parameters = inspect.signature(target).parameters
    return {name for name in actual if name not in expected and name in parameters
            and parameters[name].kind is inspect.Parameter.KEYWORD_ONLY
            and parameters[name].default is not inspect.Parameter.empty}


def _row_id(row: dict[str, Any]) -> str:
    return f"{row['module']}:{row['name']}"


@pytest.mark.parametrize("row", ROWS, ids=_row_id)
def test_name_matches_accelerate(row):
    problem = check(row)
    assert problem is None, problem


def test_every_name_the_examples_use_resolves():
    used = [r for r in ROWS if r.get("examples")]
    assert len(used) > 40  # the table was generated with --examples
    problems = [p for r in used if (p := check(r))]
    assert not problems, problems


def refused_names() -> list[str]:
    """The refused names as the docs list them: a refused class stands for its methods."""
    classes = {r["name"] for r in ROWS if r.get("refused") and "." not in r["name"]}
    names = {r["name"].split(".")[0] if r["name"].split(".")[0] in classes else r["name"]
             for r in ROWS if r.get("refused")}
    return sorted(names)


def test_refusals_are_listed_in_the_migrating_page():
    page = (Path(__file__).resolve().parents[2] / "docs" / "migrating.md").read_text()
    missing = [name for name in refused_names() if f"`{name}`" not in page]
    assert not missing, f"refused names missing from docs/migrating.md's table: {missing}"


SHOWN: dict[str, dict[str, Any]] = json.loads(TABLE.read_text())["shown"]


def shown_problem(module_name: str, name: str, entry: dict[str, Any]) -> str | None:
    """None when hasten's module at Accelerate's path shows ``name`` as Accelerate's does: the very object
    hasten has where Accelerate defines it (whose value tests/accelerate_compat/test_accelerate_modules.py checks there)."""
    where = f"{hasten_path(module_name)}.{name}"
    module = importlib.import_module(hasten_path(module_name))
    if not hasattr(module, name):
        return f"{where} is missing ({entry['from']} defines it)"
    value = getattr(module, name)
    home = getattr(importlib.import_module(hasten_path(entry["from"])), name, None)
    return None if value is home else f"{where} is not {hasten_path(entry['from'])}.{name}"


@pytest.mark.parametrize("module_name", sorted(SHOWN))
def test_module_shows_the_names_accelerate_shows(module_name):
    # Other code imports a name from where Accelerate's module shows it, not where it is defined:
    # `from accelerate.checkpointing import MODEL_NAME`, `accelerate.utils.fsdp_utils.FSDP_MODEL_NAME`.
    problems = [p for name, entry in SHOWN[module_name].items() if (p := shown_problem(module_name, name, entry))]
    assert not problems, "\n".join(problems)


def test_shown_table_covers_the_constants_other_tools_import():
    assert SHOWN["accelerate.checkpointing"]["MODEL_NAME"] == {"from": "accelerate.utils.constants",
                                                               "value": "pytorch_model"}
    assert SHOWN["accelerate.utils.fsdp_utils"]["FSDP_MODEL_NAME"]["value"] == "pytorch_model_fsdp"
    assert sum(len(names) for names in SHOWN.values()) > 350


def test_commands_utils_parser_takes_both_spellings_and_records_what_was_set():
    """Accelerate's ``CustomArgumentParser``: ``--num-processes`` is ``--num_processes``, in groups too, and
    ``namespace.nondefault`` names the options the command line set (a flag not given stays None, as there)."""
    from hasten.commands.utils import CustomArgumentParser

    parser = CustomArgumentParser()
    parser.add_argument("--num_processes", type=int, default=1)
    parser.add_argument("--use_cpu", action="store_true")
    group = parser.add_argument_group("fsdp")
    group.add_argument("--fsdp_version", type=int, default=1)
    group.add_argument("--fsdp_offload_params", action="store_true")
    args = parser.parse_args(["--num-processes", "2", "--fsdp-version", "2", "--fsdp_offload_params"])
    assert (args.num_processes, args.use_cpu, args.fsdp_version, args.fsdp_offload_params) == (2, None, 2, True)
    assert args.nondefault == {"num_processes", "fsdp_version", "fsdp_offload_params"}
    assert not hasattr(parser.parse_args([]), "nondefault")


if __name__ == "__main__":  # a summary: how many of Accelerate's names resolve
    bad = [(r, p) for r in ROWS if (p := check(r))]
    for row, problem in bad:
        print(f"{_row_id(row)}: {problem}")
    print(f"{len(ROWS) - len(bad)} of {len(ROWS)} names match")
