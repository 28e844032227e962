"""Griffe extension: read a Google-style ``Example:`` section as ``Examples:``.

hasten's docstrings head their doctest snippets ``Example:``, which the Google style allows but griffe
only recognises in the plural; otherwise the ``>>>`` lines would be rendered as Markdown quotes instead
of Python console blocks. Only the section title is rewritten, and only in the rendered documentation.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_SINGULAR = re.compile(r"^(\s*)Example:[ \t]*$", flags=re.MULTILINE)


class ExampleSectionTitle(griffe.Extension):
    """Rename ``Example:`` section titles to ``Examples:`` before docstrings are parsed."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        docstring = obj.docstring
        if docstring is not None and "Example:" in docstring.value:
            docstring.value = _SINGULAR.sub(r"\1Examples:", docstring.value)
