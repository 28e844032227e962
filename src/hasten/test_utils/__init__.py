"""Accelerate's ``accelerate.test_utils`` module path: test helpers for suites that use hasten.

``testing`` holds the decorators, test-case bases and subprocess helpers, ``training`` the regression
model and data, ``examples`` the checks of example scripts, and ``scripts`` the distributed test scripts
that ``hasten test`` launches (``test_script.py``, ``test_ops.py``, ``test_sync.py``...).

Example:
    >>> from hasten.test_utils import RegressionDataset, RegressionModel, require_cuda
"""

# ruff: noqa: F401, F403
from hasten.test_utils.testing import *
from hasten.test_utils.testing import __all__ as _testing_all
from hasten.test_utils.training import RegressionDataset, RegressionModel

from hasten.test_utils.scripts import test_ops, test_script, test_sync  # isort: skip

__all__ = [*_testing_all, "test_ops", "test_script", "test_sync"]
