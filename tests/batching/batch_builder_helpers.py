"""Shared generators for the batch-builder tests."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from opid_mega.batching.layout import flatten_contexts


@st.composite
def context_batches(draw, max_samples: int = 10, max_contexts: int = 3, vocab: int = 4):
    """Samples of 1..max_contexts contexts: shared prompt start, context-specific middle, tail, response.

    A tiny vocabulary makes accidental longer common prefixes (and contexts that are prefixes of others) likely;
    a pool of prompts makes identical prompts across samples likely.
    """
    tok = st.integers(0, vocab - 1)
    pool = draw(st.lists(st.lists(tok, min_size=1, max_size=6), min_size=1, max_size=3))
    n = draw(st.integers(0, max_samples))
    samples = []
    for _ in range(n):
        prefix = draw(st.sampled_from(pool))
        tail = draw(st.lists(tok, max_size=3))
        k = draw(st.integers(1, max_contexts))
        same_resp = draw(st.booleans())
        resp0 = draw(st.lists(tok, max_size=4))
        ctxs = []
        for _c in range(k):
            mid = draw(st.lists(tok, max_size=3))
            resp = resp0 if same_resp else draw(st.lists(tok, max_size=4))
            ctxs.append((prefix + mid + tail + resp, len(resp)))
        samples.append(ctxs)
    return flatten_contexts(samples)


def assert_same(a: dict, b: dict) -> None:
    """Byte-identical flat outputs (same keys, dtypes, shapes, bytes)."""
    assert sorted(a) == sorted(b)
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            assert isinstance(x, np.ndarray) and isinstance(y, np.ndarray), key
            assert x.dtype == y.dtype, (key, x.dtype, y.dtype)
            assert x.shape == y.shape, (key, x.shape, y.shape)
            assert x.tobytes() == y.tobytes(), key
        else:
            assert x == y, (key, x, y)


def random_alfworld_like(rng: np.random.Generator, n_tasks: int, n_traj: int, n_steps: int, prompt=(60, 120),
                         resp=(5, 20), skill=(5, 15), vocab: int = 1000):
    """A small ALFWorld-shaped batch: contexts (original, +skill) per step-sample; step 0 prompts identical
    within a task. Returns (ContextBatch, group_ids per sample, resp_lens per sample)."""
    samples, gids, rl = [], [], []
    for t in range(n_tasks):
        step0 = rng.integers(0, vocab, int(rng.integers(*prompt))).tolist()
        for _ in range(n_traj):
            for s in range(n_steps):
                p = step0 if s == 0 else rng.integers(0, vocab, int(rng.integers(*prompt))).tolist()
                cut = len(p) - int(rng.integers(1, min(10, len(p)) + 1))
                sk = rng.integers(0, vocab, int(rng.integers(*skill))).tolist()
                r = rng.integers(0, vocab, int(rng.integers(*resp))).tolist()
                samples.append([(p + r, len(r)), (p[:cut] + sk + p[cut:] + r, len(r))])
                gids.append(t)
                rl.append(len(r))
    return flatten_contexts(samples), np.array(gids, np.int64), np.array(rl, np.int64)
