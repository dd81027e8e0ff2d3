"""Run megatron-core on a machine without a GPU (gloo backend, CPU tensors).

megatron-core (0.16.1 .. 0.19.x) assumes CUDA in a handful of places that matter for a small CPU run:

1. tensor factories called with ``device="cuda"`` / ``torch.device("cuda")`` / an integer device index
   (pipeline schedules, p2p buffers, optimizer, grad-norm helpers)          -> created on the CPU;
2. ``torch.cuda.current_device()`` (rotary embedding, DDP buffers, p2p)       -> the CPU device;
3. CUDA RNG state get/set (``model_parallel_cuda_manual_seed``, the dropout RNG tracker) -> the CPU RNG;
4. ``clip_grad_by_total_norm_fp32`` asserts ``torch.cuda.FloatTensor`` grads  -> a CPU-safe equivalent;
5. ``torch.cuda.synchronize`` / ``Tensor.cuda()``                             -> no-ops;
6. ``torch.cuda.current_stream()`` (megatron-core 0.19's grad-sync waits on CUDA-graph events) -> a stream whose
   wait/record calls do nothing (there is only one "stream" on the CPU);
7. the distributed optimizer and the bf16/fp16 optimizer sort parameters by ``Tensor.type()`` names
   (``torch.cuda.FloatTensor`` ...) while they are built -> CPU tensors report the CUDA names inside those
   constructors only.

:func:`apply` installs all of these once per process and ONLY when no GPU is present; on a GPU machine it does
nothing. Everything CPU-specific in opid_mega.megatron lives in this one module.
"""
from __future__ import annotations

import functools

import torch

_APPLIED = False
_ORIGINALS: list[tuple[object, str, object]] = []  # (owner, attribute, original value) for remove()

_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "randint", "as_tensor",
              "empty_strided", "zeros_like", "ones_like", "empty_like", "full_like", "linspace")


def _is_cuda_device(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


def _cpu_device_kwarg(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    return wrapper


def _cpu_to(orig_to):
    @functools.wraps(orig_to)
    def to(self, *args, **kwargs):
        if args and _is_cuda_device(args[0]) and not isinstance(args[0], bool):
            args = ("cpu",) + args[1:]
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return orig_to(self, *args, **kwargs)

    return to


def _clip_grad_by_total_norm_fp32_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """Same maths as megatron's version (scale every grad by max_norm / (total_norm + 1e-6) when < 1)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = []
    for p in parameters:
        g = getattr(p, "decoupled_grad", None) if use_decoupled_grad else p.grad
        if g is not None:
            grads.append(g.detach())
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for g in grads:
            g.mul_(clip_coeff)


class _CpuStream:
    """Stand-in for ``torch.cuda.current_stream()`` on the CPU: work is synchronous, so waits are no-ops."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def record_event(self, event=None):
        return event

    def synchronize(self) -> None:
        pass


_CPU_STREAM = _CpuStream()


def _cuda_type_names(init):
    """``init`` with ``Tensor.type()`` (no arguments) reporting ``torch.cuda.<X>Tensor`` for CPU tensors."""

    @functools.wraps(init)
    def wrapper(*args, **kwargs):
        orig = torch.Tensor.type

        def type_(t, dtype=None, non_blocking=False, **kw):
            if dtype is None and not kw and t.device.type == "cpu":
                name = orig(t)
                return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
            return orig(t, dtype, non_blocking, **kw)

        torch.Tensor.type = type_
        try:
            return init(*args, **kwargs)
        finally:
            torch.Tensor.type = orig

    return wrapper


def _patch(owner, name: str, value) -> None:
    _ORIGINALS.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def needed() -> bool:
    return not torch.cuda.is_available()


def apply() -> bool:
    """Install the CPU shims (idempotent). Returns True when they are active."""
    global _APPLIED
    if _APPLIED:
        return True
    if not needed():
        return False
    # torch's device context (`with torch.device("meta"):`, used by HF from_pretrained) recognises factories by
    # identity through a cached set: fill that cache with the ORIGINAL functions before wrapping them, or models
    # built later in this process silently lose their device context (e.g. uninitialised RoPE inv_freq buffers).
    from torch.utils._device import _device_constructors

    _device_constructors()
    for name in _FACTORIES:
        _patch(torch, name, _cpu_device_kwarg(getattr(torch, name)))
    _patch(torch.Tensor, "to", _cpu_to(torch.Tensor.to))
    _patch(torch.Tensor, "cuda", lambda self, *a, **k: self)
    _patch(torch.cuda, "current_device", lambda: torch.device("cpu"))
    _patch(torch.cuda, "synchronize", lambda *a, **k: None)
    _patch(torch.cuda, "current_stream", lambda *a, **k: _CPU_STREAM)
    _patch(torch.cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state())
    _patch(torch.cuda, "set_rng_state", lambda state, *a, **k: torch.set_rng_state(state))
    _patch(torch.cuda.random, "get_rng_state", torch.cuda.get_rng_state)
    _patch(torch.cuda, "manual_seed", lambda seed: None)  # the CPU generator is seeded by torch.manual_seed

    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.tensor_parallel import random as mp_random

    _patch(mp_random, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state))
    if hasattr(mp_random, "_get_cuda_rng_state"):
        _patch(mp_random, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
    _patch(clip_grads, "clip_grad_by_total_norm_fp32", _clip_grad_by_total_norm_fp32_cpu)
    from megatron.core.optimizer import distrib_optimizer

    for cls in (getattr(distrib_optimizer, "DistributedOptimizer", None),
                getattr(optimizer, "Float16OptimizerWithFloat16Params", None)):
        if cls is not None:
            _patch(cls, "__init__", _cuda_type_names(cls.__init__))
    _patch(optimizer, "clip_grad_by_total_norm_fp32", _clip_grad_by_total_norm_fp32_cpu)
    _APPLIED = True
    return True


def remove() -> None:
    """Undo :func:`apply` (for in-process tests that must leave torch as they found it)."""
    global _APPLIED
    while _ORIGINALS:
        owner, name, value = _ORIGINALS.pop()
        setattr(owner, name, value)
    _APPLIED = False
