"""Write the Accelerate names that Transformers, TRL, PEFT and diffusers use to ``tests/fixtures/hf_stack_names.json``.

Run with an interpreter that has those packages installed (``make hf-venv`` builds one)::

    .hf-venv/bin/python tools/hf_stack_scan.py

It reads their installed sources (never imports them) and records, per name, which packages use it:

* ``from accelerate.x import name`` and ``import accelerate.x`` (kind ``import``);
* attribute chains rooted at ``accelerate`` (``accelerate.utils.modeling.name``; kind ``attribute``);
* ``accelerator.<attr>`` / ``self.accelerator.<attr>`` reads (kind ``accelerator``) and
  ``accelerator.state.<attr>`` reads (kind ``state``);
* keyword arguments of calls to a name imported from ``accelerate`` (kind ``keyword``, name ``Callee.kwarg``).

``tests/accelerate_compat/test_hf_stack_names.py`` checks that each exists in hasten at the same path. The ``refused``, ``note`` and
``not_accelerate`` (a false match: another object named ``accelerator``) fields are maintained by hand in the
committed file and kept when the table is regenerated.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "hf_stack_names.json"
PACKAGES = ("transformers", "trl", "peft", "diffusers")
# Objects Accelerate's users hold under these names: reads of their attributes are rows.
ACCELERATOR_NAMES = {"accelerator"}


def _chain(node: ast.AST) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]`` (``self.accelerator.x`` as ``["self", "accelerator", "x"]``)."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return parts[::-1]


class _Scanner(ast.NodeVisitor):
    def __init__(self, add: Any) -> None:
        self.add = add
        self.aliases: dict[str, str] = {}  # local name -> accelerate dotted path it stands for

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name == "accelerate" or alias.name.startswith("accelerate."):
                self.add("import", alias.name, None)
                self.aliases[alias.asname or "accelerate"] = alias.name if alias.asname else "accelerate"

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level == 0 and (module == "accelerate" or module.startswith("accelerate.")):
            for alias in node.names:
                self.add("import", module, alias.name)
                self.aliases[alias.asname or alias.name] = f"{module}.{alias.name}"

    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain = _chain(node)
        if chain is not None and isinstance(node.ctx, ast.Load):
            self._chain_read(chain)
            return  # the whole chain is one read; its prefixes are not separate names
        self.generic_visit(node)

    def _chain_read(self, chain: list[str]) -> None:
        if chain[0] == "self":
            chain = chain[1:]
        if len(chain) >= 2 and chain[0] in ACCELERATOR_NAMES:
            if chain[1] == "state" and len(chain) >= 3:
                self.add("state", "accelerate.state.AcceleratorState", chain[2])
            else:
                self.add("accelerator", "accelerate.accelerator.Accelerator", chain[1])
        elif len(chain) >= 2 and chain[0] == "accelerate" and chain[0] in self.aliases:
            self.add("attribute", ".".join(chain[:-1]), chain[-1])

    def visit_Call(self, node: ast.Call) -> None:
        chain = _chain(node.func)
        if chain and chain[0] in self.aliases and len(chain) == 1:
            target = self.aliases[chain[0]]
            module, _, name = target.rpartition(".")
            for keyword in node.keywords:
                if keyword.arg is not None:
                    self.add("keyword", module, f"{name}.{keyword.arg}")
        self.generic_visit(node)


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def scan() -> tuple[dict[str, str], list[dict[str, Any]]]:
    """``(package versions, rows)`` for every package of ``PACKAGES`` that is installed."""
    found: dict[tuple[str, str, str | None], set[str]] = defaultdict(set)
    versions: dict[str, str] = {}
    for package in PACKAGES:
        folder = _package_dir(package)
        if folder is None:
            continue
        versions[package] = importlib.metadata.version(package)
        for path in sorted(folder.rglob("*.py")):
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError):
                continue
            _Scanner(lambda kind, module, name, p=package: found[(kind, module, name)].add(p)).visit(tree)
    rows = [{"kind": kind, "module": module, "name": name, "used_by": sorted(users)}
            for (kind, module, name), users in sorted(found.items(), key=lambda item: (item[0][0], item[0][1],
                                                                                     item[0][2] or ""))]
    return versions, rows


def main() -> None:
    """Scan the installed packages and write the table, keeping the hand-kept fields of the old one."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    versions, rows = scan()
    kept: dict[tuple[str, str, str | None], dict[str, Any]] = {}
    if args.out.exists():
        for row in json.loads(args.out.read_text())["names"]:
            kept[(row["kind"], row["module"], row["name"])] = {k: row[k] for k in ("refused", "note", "not_accelerate")
                                                                 if k in row}
    for row in rows:
        row.update(kept.get((row["kind"], row["module"], row["name"]), {}))
    args.out.write_text(json.dumps({"packages": versions, "names": rows}, indent=1) + "\n")
    print(f"{len(rows)} names from {', '.join(f'{k} {v}' for k, v in versions.items())} -> {args.out}")


if __name__ == "__main__":
    main()
