"""Suite-wide: make tests/tolerance.py importable (`from tolerance import assert_close_scaled`) whatever pytest's
import mode (--import-mode=importlib does not put test directories on sys.path)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
