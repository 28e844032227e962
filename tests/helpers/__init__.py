"""Helpers shared by several test files (one module per concern); see ``tests/conftest.py``."""
