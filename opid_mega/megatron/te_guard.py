"""Transformer Engine: usable, or cleanly absent -- never a crash at import or model build.

megatron-core detects TE with ``try: import transformer_engine ... except ImportError`` (one module even with
``except ModuleNotFoundError``) while it is imported. A TE that is installed but broken -- its ``.so`` fails to load
(OSError: undefined symbol, a CUDA / torch build mismatch), or any other exception at import -- escapes those clauses
and takes ``import megatron.core`` down with it. :func:`guard` (run by ``opid_mega.megatron/__init__.py``, i.e. before
any of our modules imports megatron-core) imports TE once; when that raises anything, it prints ONE warning line and
marks TE (and its torch extension) as not importable (``sys.modules[name] = None``: every later ``import`` raises
ModuleNotFoundError, which megatron-core and our layer spec treat as "TE not installed"), so the model builds with
megatron-core's local (plain torch) layers. Without TE installed it imports nothing.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
from typing import Optional

# what a broken TE must not leave importable (the python package, its torch extension under both of its names)
TE_MODULES = ("transformer_engine", "transformer_engine_torch", "transformer_engine_extensions")

_DONE = False
_PROBLEM: Optional[str] = None  # why TE is not used although installed; None: usable or not installed


def _installed() -> bool:
    if sys.modules.get("transformer_engine", 0) is None:  # already blocked
        return False
    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except Exception:  # noqa: BLE001 - a half-imported package: treat as installed, the import below decides
        return True


def _block() -> None:
    for name in list(sys.modules):
        if any(name == m or name.startswith(m + ".") for m in TE_MODULES):
            del sys.modules[name]
    for m in TE_MODULES:
        sys.modules[m] = None


def guard() -> Optional[str]:
    """Import Transformer Engine once (if installed); on any exception block it and warn once. Returns the problem
    line, or None (TE usable, or not installed)."""
    global _DONE, _PROBLEM
    if _DONE:
        return _PROBLEM
    _DONE = True
    if not _installed():
        return None
    try:
        importlib.import_module("transformer_engine")
        importlib.import_module("transformer_engine.pytorch")
    except BaseException as exc:  # noqa: BLE001 - OSError from the .so, ImportError of a mismatched build, anything
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        _PROBLEM = f"{type(exc).__name__}: {msg}"[:300]
        _block()
        warnings.warn(f"Transformer Engine is installed but cannot be imported ({_PROBLEM}); using megatron-core's "
                      "local (plain torch) layers instead", RuntimeWarning, stacklevel=2)
    return _PROBLEM


def problem() -> Optional[str]:
    """Why an installed TE is not used (after :func:`guard`), or None."""
    return guard()


def usable() -> bool:
    """TE and megatron-core's TE extension both import (any exception counts as "no")."""
    guard()
    if sys.modules.get("transformer_engine", 0) is None:
        return False
    try:
        importlib.import_module("transformer_engine")
        from megatron.core.extensions.transformer_engine import TEDotProductAttention  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True
