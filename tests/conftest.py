"""Suite-wide: make tests/tolerance.py importable (`from tolerance import assert_close_scaled`) whatever pytest's
import mode (--import-mode=importlib does not put test directories on sys.path)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _environment_restored():
    """Each test ends with os.environ as it began: code run in-process may set variables for its ranks (the trainer
    sets OPID_KERNEL_BACKEND from scoring.kernel_backend), which would otherwise change later tests' kernels."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)
