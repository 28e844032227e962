"""Accelerate's ``accelerate.test_utils`` module path: test helpers for suites that use hasten.

Example:
    >>> from hasten.test_utils import RegressionDataset, RegressionModel, require_cuda
"""

# ruff: noqa: F401, F403
from hasten.testing.accelerate_compat import *
from hasten.testing.accelerate_compat import __all__
