"""Write Accelerate's public API inventory to ``tests/fixtures/accelerate_inventory.json``.

Run with an interpreter that has Accelerate installed (a separate venv, so hasten's own stays clean)::

    /work/wt/acc-venv/bin/python tools/accelerate_inventory.py [--examples PATH_TO_ACCELERATE_CHECKOUT/examples]

``modules`` lists every importable module of Accelerate with the public names it defines, constants
and enum members with their values, classes with their public class attributes and dataclass defaults
(``tests/accelerate_compat/test_accelerate_modules.py`` checks hasten's same paths against them); ``shown`` lists, per
module, the Accelerate names it re-exports from another module (``tests/accelerate_compat/test_accelerate_inventory.py``).

One row per public name: its module (Accelerate's path), name, kind (class, function, constant,
method, staticmethod, classmethod, property) and parameter names. Methods of Accelerate's own
classes are rows named ``Class.method``. The ``refused`` and ``note`` fields are maintained by hand
in the committed file and kept when the table is regenerated. With ``--examples``, each row also
lists the example scripts of Accelerate's repository that import or call that name.

It also records each ``accelerate`` subcommand's options (``cli_options``), which
``tests/accelerate_compat/test_cli_parity.py`` checks ``hasten``'s against. ``tests/accelerate_compat/test_accelerate_inventory.py`` reads
the names and checks hasten against them.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import importlib
import inspect
import json
import pkgutil
import types
import warnings
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "accelerate_inventory.json"

# Modules whose every Accelerate-owned public name counts (facades that collect names from elsewhere).
FACADE_MODULES = ["accelerate", "accelerate.utils", "accelerate.test_utils", "accelerate.accelerator"]
# Modules where only the names they define count (what they re-export is counted where it is defined).
DEFINING_MODULES = ["accelerate.hooks", "accelerate.big_modeling", "accelerate.data_loader", "accelerate.state",
                    "accelerate.tracking", "accelerate.logging", "accelerate.local_sgd", "accelerate.optimizer",
                    "accelerate.scheduler", "accelerate.inference", "accelerate.launchers",
                    "accelerate.parallelism_config", "accelerate.utils.operations"]
COMMAND_SUFFIXES = ("_command", "_command_parser", "_command_launcher")
SKIP_COMMANDS = {"accelerate_cli", "menu", "utils"}


def _kind(obj: Any) -> str:
    if inspect.isclass(obj):
        return "enum" if issubclass(obj, enum.Enum) else "class"
    if callable(obj):
        return "function"
    return "constant"


def _params(obj: Any) -> list[str] | None:
    target = obj
    if inspect.isclass(obj):
        if issubclass(obj, enum.Enum):
            return None
        target = obj.__init__
        if target is object.__init__:
            return []
    try:
        names = list(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        return None
    if inspect.isclass(obj) and names[:1] == ["self"]:
        names = names[1:]
    return names


def _members(cls: type, module: str) -> list[dict[str, Any]]:
    """The public methods and properties a class defines itself (inherited ones are counted where defined)."""
    rows = []
    for name, raw in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(raw, staticmethod):
            kind, func = "staticmethod", raw.__func__
        elif isinstance(raw, classmethod):
            kind, func = "classmethod", raw.__func__
        elif isinstance(raw, property):
            rows.append({"module": module, "name": f"{cls.__name__}.{name}", "kind": "property", "params": None})
            continue
        elif inspect.isfunction(raw):
            kind, func = "method", raw
        else:
            continue
        params = list(inspect.signature(func).parameters)
        if kind != "staticmethod":
            params = params[1:]
        rows.append({"module": module, "name": f"{cls.__name__}.{name}", "kind": kind, "params": params})
    return rows


def _owned(obj: Any) -> bool:
    owner = getattr(obj, "__module__", None)
    return isinstance(owner, str) and owner.startswith("accelerate")


_MEMBERS_SEEN: set[type] = set()


def _rows_for(module_name: str, facade: bool, name_filter=None) -> list[dict[str, Any]]:
    module = importlib.import_module(module_name)
    rows = []
    for name in sorted(dir(module)):
        if name.startswith("_") or (name_filter and not name_filter(name)):
            continue
        obj = getattr(module, name)
        if isinstance(obj, types.ModuleType):
            continue
        defined_here = getattr(obj, "__module__", None) == module_name
        if callable(obj):
            if not (_owned(obj) if facade else defined_here):
                continue
        elif not (name.isupper() and facade and module_name == "accelerate.utils"):
            continue  # constants: only accelerate.utils' documented UPPER_CASE ones
        rows.append({"module": module_name, "name": name, "kind": _kind(obj), "params": _params(obj)})
        if inspect.isclass(obj) and _owned(obj) and not issubclass(obj, enum.Enum) and obj not in _MEMBERS_SEEN:
            # a class's methods are counted once: where it is defined, else at the first facade showing it
            _MEMBERS_SEEN.add(obj)
            rows.extend(_members(obj, module_name))
    return rows


def _command_rows() -> list[dict[str, Any]]:
    import accelerate.commands

    rows = []
    for info in pkgutil.iter_modules(accelerate.commands.__path__):
        if info.name in SKIP_COMMANDS:
            continue
        rows += _rows_for(f"accelerate.commands.{info.name}", facade=True,
                          name_filter=lambda n: n.endswith(COMMAND_SUFFIXES))
    return rows


def _example_names(examples: Path, accelerator_members: set[str]) -> dict[tuple[str, str], list[str]]:
    """(module, name) -> example scripts that import it from an accelerate module, or call it on an object.

    A call ``anything.name(...)`` or access ``anything.name`` counts as a use of ``Accelerator.name`` when
    the Accelerator has such a member (the examples call them on their ``accelerator`` variable).
    """
    used: dict[tuple[str, str], set[str]] = {}
    for script in sorted(examples.rglob("*.py")):
        rel = str(script.relative_to(examples.parent))
        tree = ast.parse(script.read_text())
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("accelerate"):
                for alias in node.names:
                    used.setdefault((node.module, alias.name), set()).add(rel)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("accelerate"):
                        aliases[alias.asname or alias.name] = alias.name
        for node in ast.walk(tree):  # `import accelerate.utils as u; u.name` style uses
            if isinstance(node, ast.Attribute):
                dotted = ast.unparse(node.value)
                if dotted in aliases:
                    used.setdefault((aliases[dotted], node.attr), set()).add(rel)
                elif "accelerator" in dotted and node.attr in accelerator_members:
                    used.setdefault(("accelerate", f"Accelerator.{node.attr}"), set()).add(rel)
    return {key: sorted(paths) for key, paths in used.items()}


# Module paths not inventoried name by name, and why.
INTERNAL_MODULES = {
    "accelerate.commands.menu": "the terminal widgets of Accelerate's questionnaire; hasten's asks through its own",
}
# Packages whose modules are scripts: the package must exist, its scripts are hasten's own (same file names,
# their helper functions are not API).
SCRIPT_PACKAGES = ["accelerate.test_utils.scripts"]
SKIP_NAMES = {"logger"}  # every module's own logging.Logger


def _data(value: Any) -> Any:
    """A constant as JSON data, compared by value; ``None`` when it is not plain data (then only its presence
    is checked)."""
    if isinstance(value, enum.Enum):
        return _data(value.value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_data(v) for v in value]
        if any(i is None for i in items):
            return None
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    if isinstance(value, dict):
        out = {str(_data(k)): _data(v) for k, v in value.items()}
        return None if any(v is None for v in out.values()) else out
    if type(value).__name__ in ("dtype", "device"):
        return str(value)
    if inspect.isclass(value) or inspect.isfunction(value):
        return f"<{value.__name__}>"
    return None


def _top_level_assignments(module: types.ModuleType) -> set[str]:
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError):
        return set()
    names: set[str] = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        for target in targets:
            names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def _class_entry(cls: type) -> dict[str, Any]:
    if issubclass(cls, enum.Enum):
        return {"kind": "enum", "members": {m.name: _data(m.value) for m in cls}}
    attributes = {}
    fields = getattr(cls, "__dataclass_fields__", {})
    for name, raw in vars(cls).items():
        if name.startswith("_") or name in fields or callable(raw) or isinstance(
                raw, (property, staticmethod, classmethod)):
            continue
        attributes[name] = _data(raw)
    for name, field in fields.items():
        if not name.startswith("_") and field.default is not dataclasses.MISSING:
            attributes[name] = _data(field.default)
    return {"kind": "class", "attributes": attributes}


def module_table() -> dict[str, dict[str, Any]]:
    """Every importable module of Accelerate -> the public names it defines: functions, classes (enum
    members, class attributes and dataclass defaults with their values), constants with their values."""
    import accelerate

    table: dict[str, dict[str, Any]] = {"accelerate": {}}
    for info in pkgutil.walk_packages(accelerate.__path__, "accelerate.", onerror=lambda name: None):
        table[info.name] = {}
    for module_name in sorted(table):
        if any(module_name == prefix or module_name.startswith(prefix + ".") for prefix in INTERNAL_MODULES):
            del table[module_name]
            continue
        if any(module_name.startswith(prefix + ".") for prefix in SCRIPT_PACKAGES):
            del table[module_name]
            continue
        try:
            module = importlib.import_module(module_name)
        except Exception:  # a script needing a package absent here: listed, its names not
            continue
        assigned = _top_level_assignments(module)
        names: dict[str, Any] = {}
        for name in sorted(dir(module)):
            obj = getattr(module, name)
            if name.startswith("_") or name in SKIP_NAMES or isinstance(obj, types.ModuleType):
                continue
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__module__ == module_name:
                names[name] = _class_entry(obj) if inspect.isclass(obj) else {"kind": "function"}
            elif name in assigned and not callable(obj):
                names[name] = {"kind": "constant", "value": _data(obj)}
        table[module_name] = names
    return table


def _defining_module(name: str, obj: Any, defined: dict[str, dict[str, Any]]) -> str | None:
    """The module of ``defined`` where ``obj`` (shown elsewhere under ``name``) is defined, if Accelerate's."""
    if inspect.isclass(obj) or inspect.isfunction(obj):
        owner = getattr(obj, "__module__", "")
        return owner if name in defined.get(owner, {}) else None
    for module_name, names in defined.items():  # a constant: the module that assigns this very object
        if names.get(name, {}).get("kind") == "constant" and getattr(
                importlib.import_module(module_name), name, None) is obj:
            return module_name
    return None


def shown_table(defined: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Module -> the Accelerate names it shows but defines elsewhere (``from .constants import MODEL_NAME``):
    name -> the defining module, and the value for a constant. Facades (``accelerate``, ``accelerate.utils``)
    are left out: their rows in ``names`` cover them."""
    table: dict[str, dict[str, Any]] = {}
    for module_name in sorted(defined):
        if module_name in FACADE_MODULES:
            continue
        try:
            module = importlib.import_module(module_name)
        except Exception:  # as in module_table
            continue
        shown: dict[str, Any] = {}
        for name in sorted(dir(module)):
            obj = getattr(module, name)
            if name.startswith("_") or name in SKIP_NAMES or name in defined[module_name] or isinstance(
                    obj, types.ModuleType):
                continue
            source = _defining_module(name, obj, defined)
            if source is not None and source != module_name:
                entry: dict[str, Any] = {"from": source}
                if defined[source][name]["kind"] == "constant":
                    entry["value"] = _data(obj)
                shown[name] = entry
        if shown:
            table[module_name] = shown
    return table


SHOWN_MODULE = Path(__file__).resolve().parents[1] / "src" / "hasten" / "_accelerate_shown.py"
_SHOWN_HEADER = '''"""The names each Accelerate module shows but defines elsewhere (its imports: ``accelerate.checkpointing``
shows ``MODEL_NAME`` from ``accelerate.utils.constants``), as hasten paths: hasten module -> name -> the
hasten module at the path where Accelerate defines it. ``hasten._lazy``'s module ``__getattr__`` functions
look a missing name up here, so the name resolves to the one definition on first use.

Written by ``tools/accelerate_inventory.py`` from an installed Accelerate (its ``shown`` table); do not edit.
"""

from __future__ import annotations


def _names(module: str, names: str) -> dict[str, str]:
    return dict.fromkeys(names.split(), module)


SHOWN: dict[str, dict[str, str]] = {
'''


def _hasten(module: str) -> str:
    return "hasten" + module[len("accelerate"):]


def write_shown_module(shown: dict[str, dict[str, Any]]) -> None:
    """``src/hasten/_accelerate_shown.py`` from the ``shown`` table (grouped by defining module, wrapped)."""
    import textwrap

    lines = [_SHOWN_HEADER]
    for module_name, names in sorted(shown.items()):
        lines.append(f'    "{_hasten(module_name)}": {{\n')
        by_source: dict[str, list[str]] = {}
        for name, entry in sorted(names.items()):
            by_source.setdefault(_hasten(entry["from"]), []).append(name)
        for source, group in sorted(by_source.items()):
            indent = 21 + len(source)  # under the first string: `        **_names("<source>", "`
            wrapped = textwrap.wrap(" ".join(group), 110 - indent - 4)
            body = "\n".join(" " * indent + '"' + part + (" " if i < len(wrapped) - 1 else "") + '"'
                             for i, part in enumerate(wrapped)).lstrip()
            lines.append(f'        **_names("{source}", {body}),\n')
        lines.append("    },\n")
    lines.append("}\n")
    SHOWN_MODULE.write_text("".join(lines))


def build(examples: Path | None) -> list[dict[str, Any]]:
    """Every inventory row, sorted, with hand-kept fields carried over from the committed table."""
    warnings.simplefilter("ignore")
    rows: list[dict[str, Any]] = []
    for name in DEFINING_MODULES:  # first, so that classes' methods are listed where they are defined
        rows += _rows_for(name, facade=False)
    for name in FACADE_MODULES:
        rows += _rows_for(name, facade=True)
    rows += _command_rows()
    unique = {(r["module"], r["name"]): r for r in rows}
    if examples is not None:
        members = {r["name"].split(".", 1)[1] for r in rows if r["name"].startswith("Accelerator.")}
        for (module, name), scripts in _example_names(examples, members).items():
            row = unique.get((module, name))
            if row is None:
                obj = getattr(importlib.import_module(module), name, None)
                if obj is None:
                    continue
                row = unique[(module, name)] = {"module": module, "name": name, "kind": _kind(obj),
                                                "params": _params(obj)}
            row["examples"] = scripts
    old = {}
    if OUT.exists():
        old = {(r["module"], r["name"]): r for r in json.loads(OUT.read_text())["names"]}
    for key, row in unique.items():
        kept = old.get(key, {})
        for field in ("refused", "note"):
            if field in kept:
                row[field] = kept[field]
        if examples is None and "examples" in kept:
            row["examples"] = kept["examples"]
    for key, row in old.items():  # names of modules that need a package the generating venv lacks
        unique.setdefault(key, row)
    return [unique[k] for k in sorted(unique)]


def cli_options() -> dict[str, list[dict[str, Any]]]:
    """Each ``accelerate`` subcommand's options: their spellings and, where restricted, their choices."""
    from accelerate.commands.config import get_config_parser
    from accelerate.commands.env import env_command_parser
    from accelerate.commands.estimate import estimate_command_parser
    from accelerate.commands.launch import launch_command_parser
    from accelerate.commands.merge import merge_command_parser
    from accelerate.commands.test import test_command_parser
    from accelerate.commands.to_fsdp2 import to_fsdp2_command_parser
    from accelerate.commands.tpu import tpu_command_parser

    parsers = {"launch": launch_command_parser(), "config": get_config_parser(), "env": env_command_parser(),
               "estimate-memory": estimate_command_parser(), "merge-weights": merge_command_parser(),
               "test": test_command_parser(), "to-fsdp2": to_fsdp2_command_parser(), "tpu-config": tpu_command_parser()}
    out = {}
    for command, parser in parsers.items():
        out[command] = [{"options": action.option_strings,
                         "choices": [str(c) for c in action.choices] if action.choices else None}
                        for action in parser._actions if action.option_strings and action.dest != "help"]
    return out


CONFIGS_DIR = OUT.parent / "accelerate_configs"


def questionnaire_configs() -> dict[str, Any]:
    """Configuration files as Accelerate writes them (its ``ClusterConfig``, which ``accelerate config``
    fills from the answers), one per branch of the questionnaire."""
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils import ComputeEnvironment, DistributedType

    local = ComputeEnvironment.LOCAL_MACHINE
    base = {"compute_environment": local, "use_cpu": False, "debug": False}
    fsdp = {"fsdp_version": 2, "fsdp_reshard_after_forward": True, "fsdp_offload_params": False,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_transformer_layer_cls_to_wrap": "BertLayer",
            "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_sync_module_states": True, "fsdp_activation_checkpointing": False}
    deepspeed = {"zero_stage": 3, "offload_optimizer_device": "cpu", "offload_param_device": "none",
                 "gradient_accumulation_steps": 1, "gradient_clipping": 1.0, "zero3_save_16bit_model": True,
                 "zero3_init_flag": True, "deepspeed_multinode_launcher": "standard"}
    dynamo = {"dynamo_backend": "INDUCTOR", "dynamo_mode": "default", "dynamo_use_fullgraph": False,
              "dynamo_use_dynamic": False, "dynamo_use_regional_compilation": False}
    te = {"backend": "TE", "use_autocast_during_eval": False, "margin": 0, "interval": 1, "fp8_format": "HYBRID",
          "amax_history_length": 1024, "amax_compute_algorithm": "max",
          "override_linear_precision": [False, False, False]}
    configs = {
        "cpu_multi_process": dict(base, distributed_type=DistributedType.MULTI_CPU, mixed_precision="no",
                                  use_cpu=True, num_processes=2, mpirun_config={}),
        "multi_gpu_dynamo": dict(base, distributed_type=DistributedType.MULTI_GPU, mixed_precision="bf16",
                                 num_processes=2, gpu_ids="all", dynamo_config=dynamo),
        "multi_node": dict(base, distributed_type=DistributedType.MULTI_GPU, mixed_precision="fp16", num_processes=8,
                           num_machines=2, machine_rank=1, main_process_ip="10.0.0.1", main_process_port=29500,
                           rdzv_backend="c10d", same_network=True),
        "fsdp2": dict(base, distributed_type=DistributedType.FSDP, mixed_precision="bf16", num_processes=2,
                      fsdp_config=fsdp),
        "deepspeed_zero3": dict(base, distributed_type=DistributedType.DEEPSPEED, mixed_precision="bf16",
                                num_processes=2, deepspeed_config=deepspeed),
        "fp8_te": dict(base, distributed_type=DistributedType.MULTI_GPU, mixed_precision="fp8", num_processes=2,
                       fp8_config=te),
        "fp8_ao": dict(base, distributed_type=DistributedType.MULTI_GPU, mixed_precision="fp8", num_processes=2,
                       fp8_config={"backend": "AO", "enable_fsdp_float8_all_gather": True, "pad_inner_dim": True}),
        "fp8_msamp": dict(base, distributed_type=DistributedType.NO, mixed_precision="fp8",
                          fp8_config={"backend": "MSAMP", "optimization_level": "O2"}),
        "megatron_lm": dict(base, distributed_type=DistributedType.MEGATRON_LM, mixed_precision="bf16",
                            num_processes=2, megatron_lm_config={"megatron_lm_tp_degree": 2,
                                                                 "megatron_lm_pp_degree": 1}),
    }
    return {name: ClusterConfig(**values) for name, values in configs.items()}


def write_configs() -> None:
    """Write :func:`questionnaire_configs` and ``write_basic_config``'s file under ``CONFIGS_DIR``."""
    from accelerate.utils import write_basic_config

    CONFIGS_DIR.mkdir(parents=True, exist_ok=True)
    for name, config in questionnaire_configs().items():
        config.to_yaml_file(CONFIGS_DIR / f"{name}.yaml")
    basic = CONFIGS_DIR / "write_basic_config.json"
    basic.unlink(missing_ok=True)
    write_basic_config(save_location=str(basic))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=Path, default=None,
                        help="an Accelerate checkout's examples/ folder, to record which names the examples use")
    args = parser.parse_args()
    import accelerate

    rows = build(args.examples)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    payload = {"accelerate_version": accelerate.__version__, "cli_options": cli_options(), "names": rows,
               "internal_modules": INTERNAL_MODULES, "script_packages": SCRIPT_PACKAGES, "modules": module_table()}
    payload["shown"] = shown_table(payload["modules"])
    write_shown_module(payload["shown"])
    OUT.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"{len(rows)} rows -> {OUT}")
    write_configs()
    print(f"configuration files -> {CONFIGS_DIR}")


if __name__ == "__main__":
    main()
