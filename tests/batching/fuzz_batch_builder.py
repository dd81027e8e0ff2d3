"""Fuzz the C++ batch builder with malformed inputs: every call must return or raise TypeError/ValueError.

Run as a script (`python fuzz_batch_builder.py SEED ITERS`) so that a crash kills only this process.
"""
import sys

import numpy as np

from opid_mega import _C

ALLOWED = (TypeError, ValueError)


def pick(rng, options, p=None):
    """One element of `options` as is (rng.choice would coerce mixed types to one numpy dtype)."""
    return options[int(rng.choice(len(options), p=p))]


def rand_int_array(rng, n, lo=-5, hi=40):
    kind = rng.integers(0, 12)
    if kind == 0:
        return rng.integers(lo, hi, n).astype(pick(rng, [np.int32, np.uint64, np.float64, np.int16]))
    if kind == 1:
        return rng.integers(lo, hi, (n, 2)).astype(np.int64)
    if kind == 2:
        return rng.integers(lo, hi, 2 * n + 1).astype(np.int64)[::2]
    if kind == 3:
        return rng.integers(lo, hi, n).tolist()
    if kind == 4:
        return np.int64(3)
    if kind == 5:
        return pick(rng, [None, "abc", 1.5, object()])
    if kind == 6:
        return np.array(rng.integers(-(2**62), 2**62, n), dtype=np.int64)
    return rng.integers(lo, hi, n).astype(np.int64)


def valid_batch(rng, plain):
    n_s = int(rng.integers(0, 6))
    ctx_per = rng.integers(1, 2 if plain else 4, n_s)
    lens = rng.integers(1, 12, int(ctx_per.sum()))
    resp = np.array([rng.integers(0, ln) for ln in lens], np.int64)
    co = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    so = np.concatenate([[0], np.cumsum(ctx_per)]).astype(np.int64)
    tokens = rng.integers(0, 3, int(co[-1])).astype(pick(rng, [np.int64, np.int32]))
    if tokens.size and rng.random() < 0.1:  # an int64 id that does not fit the packed int32
        tokens = tokens.astype(np.int64)
        tokens[int(rng.integers(0, tokens.size))] = pick(rng, [2**31, -(2**31) - 1, 2**62])
    return [tokens, co, resp, so]


def corrupt_offsets(rng, off):
    off = off.copy()
    if off.size == 0:
        return off
    i = int(rng.integers(0, off.size))
    off[i] = pick(rng, [-1, off[i] + 1, off[i] - 1, 2**62, -(2**62), 0])
    return off


def one(rng):
    plain = bool(rng.integers(0, 2))
    args = valid_batch(rng, plain)
    mode = rng.integers(0, 4)
    if mode == 0:
        j = int(rng.integers(0, 4))
        args[j] = rand_int_array(rng, max(1, len(args[j]) if hasattr(args[j], "__len__") else 1))
    elif mode == 1:
        j = int(rng.integers(0, 4))
        if j in (1, 3):
            args[j] = corrupt_offsets(rng, args[j])
        elif j == 2 and args[2].size:
            args[2][int(rng.integers(0, args[2].size))] = pick(rng, [-1, 100, 2**62])
    budget = pick(rng, [int(rng.integers(-3, 60)), 0, 2**31, 2**40, 7.5, None, True, np.int64(30)],
                        p=[0.6] + [0.4 / 7] * 7)
    ranks = pick(rng, [1, 2, 0, -1, 2**21, 2**20, np.int32(3), 1.0], p=[0.4, 0.3] + [0.3 / 6] * 6)
    min_mb = pick(rng, [1, 3, 0, 2**20, 2**30], p=[0.5, 0.3, 0.1, 0.05, 0.05])
    tv = None
    if rng.integers(0, 3) == 0:
        ok = isinstance(args[2], np.ndarray) and args[2].dtype == np.int64 and args[2].ndim == 1
        n = int(np.sum(args[2])) if ok else 3
        tv = rng.standard_normal(max(0, min(n, 10**6) + int(rng.integers(-1, 2))))
        tv = tv.astype(pick(rng, [np.float32, np.float64]))
    try:
        _C.build_batches(*args, budget, ranks, plain=plain, share_prompts=bool(rng.integers(0, 2)),
                         max_group_tokens=pick(rng, [None, 5, 0, 10**12]), min_micro_batches=min_mb,
                         token_values=tv)
    except ALLOWED:
        pass
    try:
        _C.plan_micro_batches(rand_int_array(rng, int(rng.integers(0, 8))), budget, ranks, min_mb)
    except ALLOWED:
        pass
    n = int(rng.integers(0, 6))
    resp = rand_int_array(rng, n, -2, 4)
    total = int(np.sum(resp)) if isinstance(resp, np.ndarray) and resp.dtype == np.int64 and resp.ndim == 1 else 2
    total = max(0, min(total, 1000)) + int(rng.integers(-1, 2))
    scores = rng.standard_normal(max(0, n + int(rng.integers(-1, 2))) if rng.integers(0, 4) == 0 else n)
    if rng.integers(0, 5) == 0:
        scores[...] = np.nan
    deltas = [rng.standard_normal(max(total, 0)).astype(pick(rng, [np.float32, np.float64, np.float16]))]
    masks = [rng.integers(0, 2, max(0, n + int(rng.integers(-1, 2))) if rng.integers(0, 4) == 0 else n)
             .astype(pick(rng, [np.bool_, np.uint8, np.int64]))]
    lam = [pick(rng, [0.0, 1.0, -1.0, float("nan"), float("inf")])]
    if rng.integers(0, 6) == 0:
        lam = lam + [1.0]
    if rng.integers(0, 6) == 0:
        lam = ["x"]
    clip = pick(rng, [None, 1.0, 0.0, -1.0, float("nan")])
    try:
        _C.token_advantages(scores, resp, deltas, masks, lam, bool(rng.integers(0, 2)), clip)
    except ALLOWED:
        pass
    try:
        _C.outcome_advantage(scores, rand_int_array(rng, len(scores)), pick(rng, ["mean_norm", "bad"]), 1e-6)
    except ALLOWED:
        pass


def main(seed: int, iters: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(iters):
        one(rng)
    print("fuzz ok")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
