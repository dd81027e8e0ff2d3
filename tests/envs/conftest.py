import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _env_fuzz


@pytest.fixture(scope="session")
def textworld_cache(tmp_path_factory):
    """Games generated once per test session (a few seconds each), in a temp dir."""
    return str(tmp_path_factory.mktemp("textworld_games"))


@pytest.fixture(scope="session")
def alfworld_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("alfworld_games"))
