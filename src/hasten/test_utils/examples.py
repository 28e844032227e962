"""Accelerate's ``accelerate.test_utils.examples``: check that a "complete" example script contains the
code each ``examples/by_feature`` script adds to the base ``examples/nlp_example.py``.

``compare_against_test`` returns the lines a feature script adds that the complete script lacks (empty
when it has them all); it reads ``examples/nlp_example.py`` relative to the working directory.
"""

from __future__ import annotations

import os
from pathlib import Path

_DL_LINE = "train_dataloader, eval_dataloader = get_dataloaders(accelerator, batch_size)\n"


def get_function_contents_by_name(lines: list[str], name: str) -> list[str] | None:
    """The lines of function ``name`` (``"training_function"`` or ``"main"``) in a script's ``lines``: from
    its ``def`` up to the next ``def main`` (for ``training_function``) or ``if __name__`` (for ``main``)."""
    if name not in ("training_function", "main"):
        raise ValueError(f"Incorrect function name passed: {name}, choose either 'main' or 'training_function'")
    end = "def main" if name == "training_function" else "if __name__"
    found: list[str] = []
    for line in lines:
        if not found:
            if f"def {name}" in line:
                found.append(line)
            continue
        if end in line:
            return found
        found.append(line)
    return None


def clean_lines(lines: list[str]) -> list[str]:
    """``lines`` without comment lines and empty lines."""
    return [line for line in lines if not line.lstrip().startswith("#") and line != "\n"]


def _function(path: str | os.PathLike[str], name: str) -> list[str]:
    lines = get_function_contents_by_name(Path(path).read_text().splitlines(keepends=True), name)
    if lines is None:
        raise ValueError(f"{path} has no `def {name}` followed by the end marker; compare scripts that have one.")
    return clean_lines(lines)


def _new_lines(lines: list[str], base: list[str], skip_mock_setting: bool) -> list[str]:
    """The lines of ``lines`` not in ``base`` (the data-loader line and mocked-loader switches ignored)."""
    new: list[str] = []
    skip_next = False
    for line in lines:
        if skip_next:
            skip_next = False
            continue
        if line in base or line.lstrip() == _DL_LINE:
            continue
        if "TESTING_MOCKED_DATALOADERS" in line:
            skip_next = skip_mock_setting  # the `config["num_epochs"] = 2` line that follows
            continue
        new.append(line)
    return new


def compare_against_test(base_filename: str, feature_filename: str, parser_only: bool,
                         secondary_filename: str | None = None) -> list[str]:
    """The lines ``feature_filename`` adds to ``examples/nlp_example.py`` that ``base_filename`` lacks.

    Args:
        base_filename: a complete example, e.g. ``examples/complete_nlp_example.py``.
        feature_filename: a feature example whose additions must all be in ``base_filename``.
        parser_only: compare the ``main()`` functions (argument parsing) instead of ``training_function``.
        secondary_filename: the template of ``base_filename`` when it is not ``nlp_example.py`` (for example
            ``examples/cv_example.py``); lines it holds are not reported.
    """
    name = "main" if parser_only else "training_function"
    template_path = os.path.abspath(os.path.join("examples", "nlp_example.py"))
    template = _function(template_path, name)
    feature_new = _new_lines(_function(feature_filename, name)[:-1], template, skip_mock_setting=True)
    base_new = _new_lines(_function(base_filename, name), template, skip_mock_setting=False)
    diff = [line for line in feature_new if line not in base_new]
    if secondary_filename is not None:
        secondary = _function(secondary_filename, name)
        template_only = [line for line in Path(template_path).read_text().splitlines(keepends=True)
                         if line not in secondary]
        diff = [line for line in diff if line not in template_only]
    return diff
