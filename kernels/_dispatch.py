"""Backend selection shared by the kernels (no triton import here: `import opid_mega.kernels` must work anywhere).

backend="auto":   Triton when the tensor is on CUDA (and triton imports); Triton on CPU under the Triton
                  interpreter when BOTH `TRITON_INTERPRET=1` and `OPID_TRITON_INTERPRET=1` are set; torch otherwise.
backend="triton": Triton; on a CPU tensor this needs `TRITON_INTERPRET=1` set before the kernel module is imported.
backend="torch":  the chunked torch path (CPU production path and reference).
A run's `scoring.kernel_backend` reaches the kernels as the `backend` argument their callers pass, not through the
environment (opid_mega.megatron's model and core attention take it as their `kernel_backend` argument).
"""
from __future__ import annotations

import importlib
import os

import torch

BACKENDS = ("auto", "triton", "torch")


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def triton_interpret_enabled() -> bool:
    return _env_flag("TRITON_INTERPRET")


def triton_available() -> bool:
    try:
        importlib.import_module("triton")
    except Exception:  # pragma: no cover - triton missing or broken
        return False
    return True


def resolve_backend(backend: str, tensor: torch.Tensor, kernel: str) -> str:
    """Return "triton" or "torch" for `tensor`, raising a clear error for impossible requests."""
    if backend not in BACKENDS:
        raise ValueError(f"{kernel}: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    if backend == "auto":
        if tensor.is_cuda and triton_available():
            return "triton"
        if (not tensor.is_cuda and _env_flag("OPID_TRITON_INTERPRET") and triton_interpret_enabled()
                and triton_available()):
            return "triton"
        return "torch"
    # explicit triton
    if not triton_available():
        raise RuntimeError(f"{kernel}: backend='triton' requested but triton cannot be imported")
    if not tensor.is_cuda and not triton_interpret_enabled():
        raise RuntimeError(
            f"{kernel}: backend='triton' on a {tensor.device} tensor needs the Triton interpreter: set "
            "TRITON_INTERPRET=1 in the environment before the kernel module is first imported")
    return "triton"


def load_triton_module(name: str, tensor: torch.Tensor):
    """Import `opid_mega.kernels.<name>` (the Triton half of a kernel) lazily and check its mode fits `tensor`."""
    mod = importlib.import_module(f"opid_mega.kernels.{name}")
    if not tensor.is_cuda and not getattr(mod, "INTERPRETED", False):
        raise RuntimeError(
            f"opid_mega.kernels.{name} was imported without TRITON_INTERPRET=1, so its kernels are compiled for a "
            "GPU and cannot run on CPU tensors; set TRITON_INTERPRET=1 before the first import (new process)")
    if tensor.is_cuda and getattr(mod, "INTERPRETED", False):
        raise RuntimeError(
            f"opid_mega.kernels.{name} was imported with TRITON_INTERPRET=1 (CPU interpreter) but got a CUDA "
            "tensor; unset TRITON_INTERPRET to run the compiled kernels")
    return mod
