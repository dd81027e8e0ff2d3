"""Tolerances scaled to the magnitudes compared, for tests that compare two floating-point code paths.

Two fp32 computations of one quantity (another summation order, another kernel, TP2 against TP1, a packed against a
padded layout, fp32 against a float64 reference) differ by some ulps *of the magnitudes involved*, not by a fixed
absolute amount: gradients of size ~5 move by more than 1e-5 from summation order alone. So every such comparison
here is

    max |actual - expected| <= (rel + ulps * eps32) * scale,    scale = max |expected|  (unless the caller names one)

`scale=` names the magnitude explicitly where the compared quantity comes out of a cancellation (a KL computed from
log-probs of size ~10 is itself ~1e-3: its rounding error is set by the log-probs, not by the KL), or one scale for a
group of tensors (every parameter's gradient of one backward pass). `floor=` keeps the scale from collapsing when the
expected values are all ~0. Comparisons that are exact by construction (same code path, integer data) stay `==`.

Imported as `from tolerance import ...` (tests/conftest.py puts this directory on sys.path, whatever the import mode).
Set OPID_TOLERANCE_LOG=<file> to append one JSON line per comparison (the fraction of its tolerance used), for sizing.
"""
from __future__ import annotations

import json
import os

import numpy as np

FP32_EPS = float(np.finfo(np.float32).eps)  # 1.19e-7: one fp32 ulp at magnitude 1
_TINY = float(np.finfo(np.float32).tiny)


def _as_f64(x) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor (any device, any dtype)
        import torch

        return x.detach().to("cpu", torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def tolerance_for(expected, *, rel: float = 1e-5, ulps: float = 4, scale: float | None = None,
                  floor: float = 0.0) -> float:
    """The absolute tolerance assert_close_scaled uses for `expected`: (rel + ulps * eps32) * scale."""
    e = _as_f64(expected)
    if scale is None:
        finite = np.abs(e[np.isfinite(e)])
        scale = float(finite.max()) if finite.size else 0.0
    return (rel + ulps * FP32_EPS) * max(float(scale), floor, _TINY)


def assert_close_scaled(actual, expected, *, rel: float = 1e-5, ulps: float = 4, scale: float | None = None,
                        floor: float = 0.0, msg: str = "") -> None:
    """Assert max |actual - expected| <= (rel + ulps * eps32) * scale, scale = max |expected| unless given (and at
    least `floor`). Shapes must match; NaN/inf must sit at the same places with the same values. Tensors (torch or
    numpy), sequences and scalars are compared in float64."""
    a, e = _as_f64(actual), _as_f64(expected)
    where = f"{msg}: " if msg else ""
    if a.shape != e.shape:
        raise AssertionError(f"{where}shapes differ: actual {a.shape} vs expected {e.shape}")
    tol = tolerance_for(e, rel=rel, ulps=ulps, scale=scale, floor=floor)
    bad = np.isfinite(a) != np.isfinite(e)
    both = ~np.isfinite(a) & ~np.isfinite(e)
    bad |= both & ~((a == e) | (np.isnan(a) & np.isnan(e)))
    if bad.any():
        i = np.unravel_index(int(np.argmax(bad)), a.shape)
        raise AssertionError(f"{where}non-finite values differ at index {tuple(map(int, i))}: actual {float(a[i])!r}, "
                             f"expected {float(e[i])!r}")
    diff = np.where(np.isfinite(e), np.abs(a - e), 0.0)
    if diff.size == 0:
        return
    k = int(np.argmax(diff))
    worst = float(diff.reshape(-1)[k])
    used = worst / tol
    log = os.environ.get("OPID_TOLERANCE_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", ""), "msg": msg, "used": used,
                                "max_abs_diff": worst, "tol": tol, "rel": rel}) + "\n")
    if worst > tol:
        i = tuple(int(j) for j in np.unravel_index(k, a.shape))
        s = tol / (rel + ulps * FP32_EPS)
        raise AssertionError(
            f"{where}max |actual - expected| = {worst:.3e} at index {i} (actual {float(a[i])!r}, "
            f"expected {float(e[i])!r}) > tolerance {tol:.3e} = ({rel:g} + {ulps:g} ulp) x scale {s:.3e}; "
            f"shape {a.shape}")


def assert_dicts_close_scaled(actual: dict, expected: dict, *, rel: float = 1e-5, ulps: float = 4,
                              scale: float | str | None = None, floor: float = 0.0, msg: str = "") -> None:
    """assert_close_scaled for every key of two dicts of tensors (the same keys), e.g. gradients by parameter name.
    scale=None: each tensor against its own max; scale="global": every tensor against the largest |expected| over
    all keys (one backward pass: the rounding of a small gradient is set by the magnitudes it was summed from)."""
    if set(actual) != set(expected):
        raise AssertionError(f"{msg}: keys differ: {sorted(set(actual) ^ set(expected))}")
    if scale == "global":
        scale = max((float(np.abs(_as_f64(v)).max()) if _as_f64(v).size else 0.0) for v in expected.values())
    for k in expected:
        assert_close_scaled(actual[k], expected[k], rel=rel, ulps=ulps, scale=scale, floor=floor,
                            msg=f"{msg} {k}".strip())
