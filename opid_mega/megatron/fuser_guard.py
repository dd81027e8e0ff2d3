"""megatron-core's ``jit_fuser``: its own no-op in our processes, so that no rank pays for torch.compile it never uses.

megatron-core decorates its fused element-wise helpers (bias-GeLU/SwiGLU/GeGLU, bias-dropout-add, fused cross entropy,
MoE routing ...) with ``megatron.core.jit.jit_fuser``, which is ``torch.compile`` on torch >= 2.2. Decorating calls
``torch.compile`` at import time, and that imports dynamo and inductor: about 1.1 s on an idle core, more under load,
in every process that imports megatron-core (each rank, each restart, each opid-logprobs call). Our models turn every
one of those fusions off (``opid_mega.megatron.model``: ``bias_activation_fusion`` ... ``apply_rope_fusion`` all
False), so no decorated function runs, and the import buys nothing.

:func:`install` (run by ``opid_mega/megatron/__init__.py``, i.e. before any of our modules imports megatron-core) adds
an import hook that, right after ``megatron.core.jit`` executes, calls megatron-core's own ``disable_jit_fuser()``
(``jit_fuser`` becomes its ``noop_decorator``). The model's numbers are unchanged: the functions it would wrap are
never called. It does nothing when:

- megatron-core is already imported (a user's Megatron script that imported it first keeps its fuser);
- ``OPID_MEGATRON_JIT_FUSER=1`` is set (keep megatron-core's default, e.g. for a model of your own with fusions on);
- the installed megatron-core has no ``disable_jit_fuser`` (then its default stays).
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from typing import Optional, Sequence

ENV = "OPID_MEGATRON_JIT_FUSER"
TARGET = "megatron.core.jit"


class _Loader(importlib.abc.Loader):
    """Runs megatron-core's own loader for ``megatron.core.jit``, then its ``disable_jit_fuser()``."""

    def __init__(self, inner: importlib.abc.Loader):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        disable = getattr(module, "disable_jit_fuser", None)
        if callable(disable):
            disable()


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core.jit`` with the normal path finder and wraps its loader; removes itself once used."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target=None):
        if fullname != TARGET:
            return None
        uninstall()
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _Loader(spec.loader)
        return spec


_FINDER = _Finder()


def install() -> bool:
    """Add the hook unless megatron-core's jit module is already imported or OPID_MEGATRON_JIT_FUSER=1. Returns
    whether the hook is (now) in place."""
    if os.environ.get(ENV, "").strip() == "1" or TARGET in sys.modules:
        return False
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    return True


def uninstall() -> None:
    while _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
