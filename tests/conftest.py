"""The suite's root: makes ``tests/helpers`` importable from every test folder.

Test files never import each other; what several of them share lives in ``tests/helpers/`` (plain
functions and constants) or in ``hasten.testing`` (the harness: forked ranks, the pytest plugin's
fixtures). pytest's default ``prepend`` import mode puts each test file's own folder on ``sys.path``;
this file adds ``tests/`` itself, so ``from helpers.checkpoints import ...`` works from any folder.
"""

import sys
from pathlib import Path

import pytest

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)


@pytest.fixture(scope="module")
def deepspeed_in_parent() -> None:
    """Import DeepSpeed once in the parent (``pytestmark = pytest.mark.usefixtures("deepspeed_in_parent")``),
    so that the ranks forked from it do not each pay for the import."""
    from hasten.testing import preload_deepspeed

    preload_deepspeed()
