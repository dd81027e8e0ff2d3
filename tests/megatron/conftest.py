"""Megatron backend tests: make this directory's helper modules importable (megatron_testutil,
_megatron_worker) whatever pytest's import mode; `mp1`, megatron-core's parallel state for one rank (TP1 PP1)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def mp1():
    """megatron-core's parallel state for one in-process rank (TP1 PP1), for a module's tests; torn down after."""
    from opid_mega.megatron import parallel

    parallel.initialize(1, 1)
    yield
    parallel.destroy_all()
