"""The documentation site builds without a single warning, and documents every public name.

The build is the one ``make docs`` runs (``mkdocs build --strict``), into a temporary folder. The
export check reads the API reference sources: every name in ``hasten._EXPORTS`` and
``hasten.utils._EXPORTS`` must have its own ``::: module.Name`` entry, so adding an export without
documenting it fails here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import hasten
import hasten.utils

ROOT = Path(__file__).resolve().parents[2]
API_DIR = ROOT / "docs" / "api"
BUILD_TIMEOUT_S = 180
_DIRECTIVE = re.compile(r"^:::\s+([\w.]+)\s*$", flags=re.MULTILINE)


def _documented_names() -> set[str]:
    """Last component of every ``::: dotted.path`` directive in the API reference pages."""
    names: set[str] = set()
    for page in API_DIR.glob("*.md"):
        names.update(path.rsplit(".", 1)[-1] for path in _DIRECTIVE.findall(page.read_text(encoding="utf-8")))
    return names


@pytest.fixture(scope="module")
def built_site(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """Build the site once for this module; returns (site folder, combined build output)."""
    try:
        import mkdocs  # noqa: F401
    except ImportError:
        pytest.fail("mkdocs is not installed: pip install mkdocs mkdocs-material 'mkdocstrings[python]'")
    site = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner about MkDocs 2 is not a build warning
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--clean", "-f", str(ROOT / "mkdocs.yml"),
         "-d", str(site)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{output}"
    return site, output


def test_docs_build_without_warnings(built_site: tuple[Path, str]) -> None:
    site, output = built_site
    warnings = [line for line in output.splitlines() if "WARNING" in line or "ERROR" in line]
    assert warnings == [], "mkdocs reported:\n" + "\n".join(warnings)
    assert (site / "index.html").is_file()
    assert (site / "api" / "accelerator" / "index.html").is_file()


def test_api_reference_renders_the_accelerator(built_site: tuple[Path, str]) -> None:
    html = (built_site[0] / "api" / "accelerator" / "index.html").read_text(encoding="utf-8")
    # methods inherited from the Accelerator's mixins are part of its documented surface
    for method in ("prepare", "backward", "accumulate", "gather_for_metrics", "save_state", "load_state", "log"):
        assert f'id="hasten.accelerator.Accelerator.{method}"' in html, method


def test_cli_page_shows_every_subcommand(built_site: tuple[Path, str]) -> None:
    from hasten.commands.main import build_parser

    html = (built_site[0] / "api" / "cli" / "index.html").read_text(encoding="utf-8")
    parser = build_parser()
    commands = next(a.choices for a in parser._actions if hasattr(a, "choices") and isinstance(a.choices, dict))
    assert "launch" in commands
    for name in commands:
        assert f'id="hasten-{name}"' in html, f"`hasten {name}` has no section on the CLI page"
    assert "--num_processes" in html and "--mixed_precision" in html


@pytest.mark.parametrize("module", [hasten, hasten.utils], ids=["hasten", "hasten.utils"])
def test_every_export_is_in_the_api_reference(module: object) -> None:
    documented = _documented_names()
    missing = sorted(name for name in module._EXPORTS if name not in documented)  # type: ignore[attr-defined]
    assert missing == [], (f"{module.__name__} exports {missing} but docs/api/*.md has no `::: module.Name` "  # type: ignore[attr-defined]
                           "entry for them: add one to the page of the part they belong to.")


def test_api_directives_name_real_objects() -> None:
    """Each ``::: path`` names an importable object (a typo would otherwise only fail the slow build)."""
    import importlib

    bad = []
    for page in API_DIR.glob("*.md"):
        for path in _DIRECTIVE.findall(page.read_text(encoding="utf-8")):
            module_name, _, attr = path.rpartition(".")
            try:
                target = importlib.import_module(path)
            except ImportError:
                try:
                    target = getattr(importlib.import_module(module_name), attr)
                except (ImportError, AttributeError):
                    target = None
            if target is None:
                bad.append(f"{page.name}: {path}")
    assert bad == []
