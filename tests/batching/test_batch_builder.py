"""Batch builder: C++ extension == numpy reference byte for byte; packing properties; advantages vs float64 references."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batch_builder_helpers import assert_same, context_batches, random_alfworld_like  # noqa: E402
from advantage_oracle import ref_outcome, ref_tokens  # noqa: E402
from tolerance import assert_close_scaled  # noqa: E402

from opid_mega import batching  # noqa: E402
from opid_mega.batching import reference as ref  # noqa: E402
from opid_mega.batching.layout import flatten_contexts, sample_group_tokens, sample_prefix_lengths  # noqa: E402

_C = pytest.importorskip("opid_mega._C", reason="C++ batch builder not built")


def both(fn_name, *args, **kwargs):
    return getattr(ref, fn_name)(*args, **kwargs), getattr(_C, fn_name)(*args, **kwargs)


def budget_for(ctx, draw_extra: int) -> int:
    prefix = sample_prefix_lengths(ctx.tokens, ctx.ctx_offsets, ctx.resp_lens, ctx.sample_offsets)
    sizes = sample_group_tokens(ctx.ctx_offsets, ctx.sample_offsets, prefix)
    return int(max(sizes.max(initial=1), 1)) + draw_extra


# ----------------------------------------------------------------------------------------------- equality
@settings(max_examples=150, deadline=None)
@given(ctx=context_batches(), extra=st.integers(0, 40), ranks=st.integers(1, 3), share=st.booleans(),
       min_mb=st.integers(1, 3), cap=st.booleans())
def test_fork_batches_identical(ctx, extra, ranks, share, min_mb, cap):
    budget = budget_for(ctx, extra)
    kw = dict(share_prompts=share, min_micro_batches=min_mb, max_group_tokens=budget_for(ctx, 0) if cap else None)
    a, b = both("build_batches", ctx.tokens, ctx.ctx_offsets, ctx.resp_lens, ctx.sample_offsets, budget, ranks, **kw)
    assert_same(a, b)


@settings(max_examples=100, deadline=None)
@given(ctx=context_batches(max_contexts=1), extra=st.integers(0, 40), ranks=st.integers(1, 3),
       values=st.booleans(), seed=st.integers(0, 2**31))
def test_plain_batches_identical(ctx, extra, ranks, values, seed):
    tv = None
    if values:
        tv = np.random.default_rng(seed).standard_normal(int(ctx.resp_lens.sum())).astype(np.float32)
    budget = int(np.diff(ctx.ctx_offsets).max(initial=1)) + extra
    a, b = both("build_batches", ctx.tokens, ctx.ctx_offsets, ctx.resp_lens, ctx.sample_offsets, budget, ranks,
                plain=True, token_values=tv)
    assert_same(a, b)
    if ctx.num_samples:
        assert "branch_ids" not in a and train_branch_ids_none(a)
        # plain: every sequence is its own group, positions restart at 0
        assert a["group_tokens"].tolist() == np.diff(ctx.ctx_offsets).tolist()


@settings(max_examples=60, deadline=None)
@given(ctx=context_batches(vocab=6), extra=st.integers(0, 40), ranks=st.integers(1, 3), plain=st.booleans(),
       offset=st.sampled_from([0, -(2**31), 2**31 - 8]))
def test_int32_and_int64_tokens_pack_the_same(ctx, extra, ranks, plain, offset):
    """Token ids are packed as int32: int64 input (ids that fit) gives the same bytes as int32 input, in both
    backends; extreme ids survive."""
    if plain:
        keep = np.diff(ctx.sample_offsets) == 1
        if not keep.all():
            return
    t32 = (ctx.tokens.astype(np.int64) + offset).astype(np.int32)
    budget = budget_for(ctx, extra) if not plain else int(np.diff(ctx.ctx_offsets).max(initial=1)) + extra
    outs = [impl.build_batches(t, ctx.ctx_offsets, ctx.resp_lens, ctx.sample_offsets, budget, ranks, plain=plain)
            for impl in (ref, _C) for t in (t32, t32.astype(np.int64))]
    for o in outs[1:]:
        assert_same(outs[0], o)
    for key in ("tokens", "position_ids", "gather_rows", "gather_targets", "cu_seqlens") + (() if plain else
                                                                                          ("branch_ids",)):
        assert outs[0][key].dtype == np.int32, key
    if ctx.num_samples:
        assert set(np.unique(outs[0]["tokens"]).tolist()) <= set(np.unique(t32).tolist())


def train_branch_ids_none(flat) -> bool:
    packed = batching.PackedBatches(flat, np.zeros(0, np.int64), np.zeros(1, np.int64), 0)
    return all(packed.micro_batch(r, j).branch_ids is None for r in range(packed.num_ranks)
               for j in range(packed.micro_batches_per_rank))


def test_prefix_hash_collisions_never_merge_different_prompts():
    """The C++ grouping buckets prefixes by length and their first/last 64 tokens: prompts equal there but different
    in the middle share a bucket and must still get their own groups (identical ones still share)."""
    rng = np.random.default_rng(7)
    head, tail = rng.integers(0, 100, 64).tolist(), rng.integers(0, 100, 64).tolist()
    middles = [rng.integers(0, 100, 200).tolist() for _ in range(3)]
    middles.append(list(middles[0]))
    middles[3][100] += 1  # differs from middle 0 in one token
    samples = []
    for i in [0, 1, 0, 2, 3, 0, 3]:
        prompt = head + middles[i] + tail
        resp = rng.integers(0, 100, 5).tolist()
        samples.append([(prompt + resp, 5), (prompt + [7, 7] + resp, 5)])
    ctx = flatten_contexts(samples)
    a, b = both("build_batches", ctx.tokens, ctx.ctx_offsets, ctx.resp_lens, ctx.sample_offsets, 4096, 1)
    assert_same(a, b)
    groups = [a["group_samples"][a["group_sample_offsets"][g]:a["group_sample_offsets"][g + 1]].tolist()
              for g in range(a["group_sample_offsets"].size - 1)]
    assert groups == [[0, 2, 5], [1], [3], [4, 6]]


def test_fork_values_and_extremes_identical():
    rng = np.random.default_rng(0)
    ctx, _, _ = random_alfworld_like(rng, 2, 3, 4)
    total = int(np.diff(ctx.ctx_offsets).sum())
    for budget, ranks in [(total, 1), (budget_for(ctx, 0), 1), (budget_for(ctx, 0), 4), (total, 3)]:
        tv = rng.standard_normal(int(ctx.resp_lens.sum())).astype(np.float32)
        a, b = both("build_batches", ctx.tokens, ctx.ctx_offsets, ctx.resp_lens, ctx.sample_offsets, budget, ranks,
                    token_values=tv)
        assert_same(a, b)
    # every sample in one micro-batch
    a = _C.build_batches(ctx.tokens, ctx.ctx_offsets, ctx.resp_lens, ctx.sample_offsets, total, 1)
    assert a["micro_batches_per_rank"] == 1 and a["mb_token_offsets"][-1] == a["tokens"].size
    # one sample per micro-batch: no sharing, budget = the largest sample
    a, b = both("build_batches", ctx.tokens, ctx.ctx_offsets, ctx.resp_lens, ctx.sample_offsets,
                budget_for(ctx, 0), 1, share_prompts=False, min_micro_batches=ctx.num_samples)
    assert_same(a, b)
    assert (np.diff(a["mb_group_offsets"]) == 1).all()


# ----------------------------------------------------------------------------------------------- packing
@settings(max_examples=150, deadline=None)
@given(sizes=st.lists(st.integers(0, 100), max_size=40), ranks=st.integers(1, 4), extra=st.integers(0, 200),
       min_mb=st.integers(1, 4))
def test_plan_properties(sizes, ranks, extra, min_mb):
    sizes = np.array(sizes, np.int64)
    budget = int(sizes.max(initial=1)) + extra
    budget = max(budget, 1)
    (mb_a, m_a), (mb_b, m_b) = both("plan_micro_batches", sizes, budget, ranks, min_mb)
    assert m_a == m_b and mb_a.tobytes() == mb_b.tobytes()
    k = ranks * m_a
    loads = np.bincount(mb_a, weights=sizes, minlength=k) if sizes.size else np.zeros(k)
    assert loads.max(initial=0) <= budget
    assert m_a >= min_mb and (mb_a < k).all() and (mb_a >= 0).all()
    # longest-first greedy bound: no bin exceeds the least loaded one by more than the largest item
    if sizes.size:
        assert loads.max() - loads.min() <= sizes.max()
    # m is bounded: at least what the total needs, at most one group per bin (then greedy always fits)
    assert m_a >= -(-int(sizes.sum()) // (budget * ranks))
    assert m_a <= max(min_mb, -(-sizes.size // ranks), 1)


def test_plan_balanced_across_ranks():
    rng = np.random.default_rng(1)
    sizes = rng.integers(500, 2500, 512).astype(np.int64)
    mb, m = _C.plan_micro_batches(sizes, 16384, 4)
    loads = np.bincount(mb, weights=sizes, minlength=4 * m).reshape(4, m)
    per_rank = loads.sum(1)
    assert per_rank.max() / per_rank.min() < 1.05
    assert loads.max() <= 16384
    assert sizes.sum() / (4 * m * 16384) > 0.85  # packing efficiency


# ----------------------------------------------------------------------------------------------- advantages
@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(0, 30), groups=st.integers(1, 6),
       mode=st.sampled_from(ref.OUTCOME_MODES), f32=st.booleans())
def test_outcome_advantage_identical_and_matches_float64(seed, n, groups, mode, f32):
    rng = np.random.default_rng(seed)
    scores = rng.choice([0.0, 10.0, 9.9, 1.0, 0.99], n) + rng.standard_normal(n) * 0.01
    scores = scores.astype(np.float32 if f32 else np.float64)
    gid = rng.integers(0, groups, n).astype(np.int64) * 7 - 3
    a, b = both("outcome_advantage", scores, gid, mode)
    assert a.dtype == b.dtype == np.float64 and a.tobytes() == b.tobytes()
    np.testing.assert_allclose(a, ref_outcome(scores.astype(np.float64).tolist(), gid.tolist(), mode), rtol=1e-9,
                               atol=1e-9)


def test_outcome_single_sample_and_constant_groups():
    scores = np.array([10.0, 3.0, 3.0, 3.0], np.float64)
    gid = np.array([0, 1, 1, 1], np.int64)
    a = batching.outcome_advantage(scores, gid, "mean_std_norm")
    np.testing.assert_array_equal(a, [10.0 / (1 + 1e-6), 0.0, 0.0, 0.0])
    np.testing.assert_array_equal(batching.outcome_advantage(scores, gid, "mean_norm"), [10.0, 0, 0, 0])


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(0, 12), normalize=st.booleans(),
       clip=st.sampled_from([None, 0.05, 1.0, 3.0]), lam_ep=st.sampled_from([0.0, 0.001, 1.0]),
       lam_step=st.sampled_from([0.0, 0.001, 0.5]), const=st.booleans(), f64=st.booleans())
def test_token_advantages_identical_and_matches_float64(seed, n, normalize, clip, lam_ep, lam_step, const, f64):
    rng = np.random.default_rng(seed)
    resp = rng.integers(0, 6, n).astype(np.int64)
    total = int(resp.sum())
    a_out = rng.standard_normal(n)
    orig = -rng.random(total).astype(np.float32) * 3
    skill = [-rng.random(total).astype(np.float32) * 3 for _ in range(2)]
    if const:
        skill[0] = orig + np.float32(0.25)
    dt = np.float64 if f64 else np.float32
    deltas = [(s - orig).astype(dt) for s in skill]
    use_ep = rng.random(n) < 0.6
    use_step = (rng.random(n) < 0.4).astype(np.uint8)
    args = (a_out, resp, deltas, [use_ep, use_step], [lam_ep, lam_step], normalize, clip)
    x, y = both("token_advantages", *args)
    assert x.dtype == y.dtype == np.float32 and x.tobytes() == y.tobytes()
    # float64 reference written from the rules, fed the same Δ the builder got (already rounded to `dt`): with a
    # constant Δ, normalisation divides its rounding noise by (σ + ε), so exact differences would be another input
    want = ref_tokens(a_out.tolist(), resp.tolist(), deltas, [use_ep, use_step.astype(bool)], [lam_ep, lam_step],
                      normalize, clip)
    # float32 output vs float64: within 2e-6 of the largest |A_out| + Σ λ|Δ| summed into a token (cancellations
    # leave small sums with the rounding of the large terms)
    size = [abs(a) + lam_ep * abs(e) + lam_step * abs(t) for a, e, t in
            zip(np.repeat(a_out, resp), ref_tokens([0.0] * n, resp.tolist(), [deltas[0]], [use_ep], [1.0], normalize,
                                                   clip), ref_tokens([0.0] * n, resp.tolist(), [deltas[1]],
                                                                     [use_step.astype(bool)], [1.0], normalize, clip))]
    assert_close_scaled(x, want, rel=2e-6, scale=max(size) if total else 0.0)


@settings(max_examples=120, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(0, 14), cap=st.sampled_from([0.0, 0.01, 0.3, 1.0, 50.0]),
       normalize=st.booleans(), clip=st.sampled_from([None, 1.0]), ties=st.booleans())
def test_token_advantages_share_cap_identical_and_matches_float64(seed, n, cap, normalize, clip, ties):
    """algo.skill_share_cap: C++ == numpy byte for byte, and both equal a float64 reference written from the rule
    (per group: skill mass at most cap x outcome mass; a tied group has no skill term)."""
    rng = np.random.default_rng(seed)
    resp = rng.integers(0, 6, n).astype(np.int64)
    total = int(resp.sum())
    groups = rng.integers(0, 4, n).astype(np.int64)
    a_out = rng.standard_normal(n) * 0.8
    if ties:
        a_out[groups == 0] = 0.0  # group 0's scores tie: its outcome advantages are all 0
    deltas = [(rng.standard_normal(total) * 4).astype(np.float32), rng.standard_normal(total) * 2]
    masks = [rng.random(n) < 0.7, rng.random(n) < 0.5]
    lams = [0.09, 0.3]
    args = (a_out, resp, deltas, masks, lams, normalize, clip, 1e-6, groups, cap)
    x, y = both("token_advantages", *args)
    assert x.dtype == y.dtype == np.float32 and x.tobytes() == y.tobytes()
    # float64 reference: the uncapped skill term, then the cap by hand
    plain = ref.token_advantages(np.zeros(n), resp, deltas, masks, lams, normalize, clip).astype(np.float64)
    out_t, grp_t = np.repeat(a_out, resp), np.repeat(groups, resp)
    want = out_t.copy()
    for g in set(groups.tolist()):
        at = grp_t == g
        o, k = np.abs(out_t[at]).sum(), np.abs(plain[at]).sum()
        f = 1.0 if k <= cap * o else cap * o / k
        want[at] += f * plain[at]
        got_k = np.abs(x[at].astype(np.float64) - out_t[at]).sum()
        assert got_k <= cap * o * (1 + 1e-5) + 1e-5 * (1 + k), f"group {g}: skill mass {got_k} > {cap} x {o}"
        if ties and g == 0:
            np.testing.assert_array_equal(x[at], np.zeros(int(at.sum()), np.float32))
    scale = float(np.abs(out_t).max(initial=0) + np.abs(plain).max(initial=0))
    assert_close_scaled(x, want, rel=2e-6, scale=scale)


def test_token_advantages_share_cap_errors():
    a, r = np.zeros(2), np.array([1, 1], np.int64)
    d, m = [np.zeros(2)], [np.ones(2, bool)]
    for impl in (ref, _C):
        with pytest.raises(ValueError, match="share_cap needs groups"):
            impl.token_advantages(a, r, d, m, [0.1], False, None, 1e-6, None, 1.0)
        with pytest.raises(ValueError, match="share_cap"):
            impl.token_advantages(a, r, d, m, [0.1], False, None, 1e-6, np.zeros(2, np.int64), -1.0)
        with pytest.raises(ValueError, match="groups"):
            impl.token_advantages(a, r, d, m, [0.1], False, None, 1e-6, np.zeros(3, np.int64), 1.0)


def test_advantages_flow_into_train_batches():
    rng = np.random.default_rng(3)
    ctx, gid, resp = random_alfworld_like(rng, 2, 2, 3)
    seq_off = np.concatenate([[0], np.cumsum(np.diff(ctx.ctx_offsets)[::2])]).astype(np.int64)
    toks = np.concatenate([ctx.tokens[ctx.ctx_offsets[c]:ctx.ctx_offsets[c + 1]]
                           for c in range(0, ctx.num_contexts, 2)])
    a_out = batching.outcome_advantage(rng.choice([0.0, 10.0], len(gid)), gid)
    delta = rng.standard_normal(int(resp.sum())).astype(np.float32)
    adv = batching.token_advantages(a_out, resp, [delta], [np.ones(len(gid), bool)], [0.001])
    train = batching.build_train_batches(toks, seq_off, resp, 400, 2, token_values=adv)
    per = train.unpack_logprobs(train.flat["gather_values"])
    starts = np.concatenate([[0], np.cumsum(resp)])
    for s in range(len(gid)):
        np.testing.assert_array_equal(per[s][0], adv[starts[s]:starts[s + 1]])
    for rank in range(2):
        for mb in train.micro_batches(rank):
            assert mb.tokens.size <= 400
            dense = mb.dense_values()
            np.testing.assert_array_equal(dense[mb.gather_rows], mb.gather_values)
            assert (dense[~mb.loss_mask] == 0).all() and mb.loss_mask.dtype == np.bool_
            assert mb.loss_mask.sum() == mb.gather_rows.size
            np.testing.assert_array_equal(mb.tokens[mb.gather_rows + 1], mb.gather_targets)


def test_torch_tensors_accepted_without_copy():
    t = torch.tensor([1, 2, 3, 4, 5], dtype=torch.int64)
    packed = batching.build_train_batches(t, torch.tensor([0, 3, 5]), torch.tensor([1, 1]), 16)
    assert packed.micro_batch(0, 0).tokens.tolist() == [1, 2, 3, 4, 5]


# ----------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("backend", ["python", "cpp"])
def test_clear_errors(backend):
    ctx_t = np.array([1, 2, 3, 4], np.int64)
    good = dict(tokens=ctx_t, ctx_offsets=np.array([0, 4], np.int64), resp_lens=np.array([1], np.int64),
                sample_offsets=np.array([0, 1], np.int64))
    impl = ref if backend == "python" else _C

    def call(**over):
        kw = {**good, **over}
        return impl.build_batches(kw["tokens"], kw["ctx_offsets"], kw["resp_lens"], kw["sample_offsets"],
                                  kw.get("budget", 10), kw.get("num_ranks", 1))

    with pytest.raises(TypeError, match="tokens"):
        call(tokens=ctx_t.astype(np.int16))
    with pytest.raises(TypeError, match="tokens"):
        call(tokens=ctx_t.astype(np.uint32))
    with pytest.raises(ValueError, match=r"tokens\[2\]=2147483648 does not fit in int32"):
        call(tokens=np.array([1, 2, 2**31, 4], np.int64))
    with pytest.raises(ValueError, match=r"tokens\[0\]=-2147483649 does not fit in int32"):
        call(tokens=np.array([-(2**31) - 1, 2, 3, 2**40], np.int64))
    with pytest.raises(ValueError, match="sample 0 needs 4 tokens"):  # the id range is checked last
        call(tokens=np.array([1, 2, 2**31, 4], np.int64), budget=3)
    with pytest.raises(ValueError, match="tokens"):
        call(tokens=np.arange(8, dtype=np.int64)[::2])
    with pytest.raises(ValueError, match="ctx_offsets"):
        call(ctx_offsets=np.array([0, 5], np.int64))
    with pytest.raises(ValueError, match="ctx_offsets"):
        call(ctx_offsets=np.array([0, 3, 2, 4], np.int64), resp_lens=np.zeros(3, np.int64),
             sample_offsets=np.array([0, 3], np.int64))
    with pytest.raises(ValueError, match="resp_lens"):
        call(resp_lens=np.array([1, 1], np.int64))
    with pytest.raises(ValueError, match="resp_lens"):
        call(resp_lens=np.array([4], np.int64))
    with pytest.raises(ValueError, match="budget"):
        call(budget=-1)
    with pytest.raises(ValueError, match="sample 0 needs 4 tokens"):
        call(budget=3)
    with pytest.raises(TypeError, match="sample_offsets"):
        call(sample_offsets=[0, 1])
    with pytest.raises(ValueError, match="deltas"):
        impl.token_advantages(np.zeros(1), np.array([2], np.int64), [np.zeros(3, np.float32)],
                              [np.ones(1, bool)], [1.0])
    with pytest.raises(ValueError, match="not finite"):
        impl.token_advantages(np.zeros(1), np.array([2], np.int64), [np.array([0, np.nan], np.float32)],
                              [np.ones(1, bool)], [1.0])
    with pytest.raises(ValueError, match="lambdas"):
        impl.token_advantages(np.zeros(1), np.array([2], np.int64), [np.zeros(2, np.float32)],
                              [np.ones(1, bool)], [-1.0])


@pytest.mark.parametrize("normalize", [False, True])
def test_non_finite_delta_reported_identically(normalize):
    """A NaN/inf in a routed sample's Δ is an error even for λ = 0 (the first one, type by type); one in a sample
    the mask leaves out is ignored. Both backends name the same element."""
    rl = np.array([3, 600, 2], np.int64)
    a_out = np.array([0.5, -0.5, 1.0])
    masks = [np.array([True, True, False]), np.array([False, True, True])]
    for bad_k, bad_t, lam, raises in [(0, 7, 0.0, True), (1, 400, 1.0, True), (0, 604, 1.0, False),
                                      (1, 1, 1.0, False)]:
        deltas = [np.linspace(-1, 1, 605).astype(np.float32), np.linspace(1, 2, 605)]
        deltas[bad_k][bad_t] = np.inf if bad_t % 2 else np.nan
        lams = [lam, 1.0] if bad_k == 0 else [1.0, lam]
        outs = []
        for impl in (ref, _C):
            if raises:
                with pytest.raises(ValueError, match=rf"deltas\[{bad_k}\]\[{bad_t}\] is not finite"):
                    impl.token_advantages(a_out, rl, deltas, masks, lams, normalize, None)
            else:
                outs.append(impl.token_advantages(a_out, rl, deltas, masks, lams, normalize, None))
        if outs:
            assert outs[0].tobytes() == outs[1].tobytes() and np.isfinite(outs[0]).all()


def test_fallback_warns_once():
    code = (
        "import sys, warnings\n"
        "sys.modules['opid_mega._C'] = None\n"
        "import numpy as np\n"
        "from opid_mega import batching\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    for _ in range(3):\n"
        "        batching.plan_micro_batches(np.array([3, 4], np.int64), 10)\n"
        "assert batching.backend_name() == 'python'\n"
        "assert len([x for x in w if 'numpy batch builder' in str(x.message)]) == 1, w\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_pool_reuse_never_aliases_live_arrays():
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, 50, 400_000).astype(np.int64)
    co = np.array([0, 200_000, 400_000], np.int64)
    rl = np.array([100, 100], np.int64)
    so = np.array([0, 1, 2], np.int64)
    first = _C.build_batches(tokens, co, rl, so, 300_000, 1, plain=True)
    kept = {k: v.copy() for k, v in first.items() if isinstance(v, np.ndarray)}
    for _ in range(3):  # freed outputs go back to the pool and are reused; live ones must not be touched
        out = _C.build_batches(tokens[::-1].copy(), co, rl, so, 300_000, 1, plain=True)
        del out
    for k, v in kept.items():
        assert first[k].tobytes() == v.tobytes(), k
    # the freed outputs wait in the pool for the next batch (unless OPID_BB_POOL=0 disables it)
    assert _C.buffer_pool_bytes() > 0 or os.environ.get("OPID_BB_POOL") == "0"
    _C.clear_buffer_pool()
    assert _C.buffer_pool_bytes() == 0


def test_threads_do_not_change_outputs():
    """The threaded fill (several workers over ~1.5M tokens) equals the single-threaded one, byte for byte (fork and
    plain layouts, int32 and int64 token input)."""
    code = (
        "import hashlib, sys\n"
        "import numpy as np\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
        "from batch_builder_helpers import random_alfworld_like\n"
        "from opid_mega import _C\n"
        "ctx, _, _ = random_alfworld_like(np.random.default_rng(0), 4, 8, 10, prompt=(1500, 2500))\n"
        "h = hashlib.sha256()\n"
        "tv = np.linspace(-1, 1, int(ctx.resp_lens.sum())).astype(np.float32)\n"
        "for tokens in (ctx.tokens, ctx.tokens.astype(np.int64)):\n"
        "    for plain in (False, True):\n"
        "        co, rl = ctx.ctx_offsets, ctx.resp_lens\n"
        "        so = np.arange(co.size, dtype=np.int64) if plain else ctx.sample_offsets\n"
        "        out = _C.build_batches(tokens, co, rl, so, 65536, 2, plain=plain, token_values=tv)\n"
        "        for k, v in sorted(out.items()):\n"
        "            h.update(k.encode() + (v.tobytes() if hasattr(v, 'tobytes') else str(v).encode()))\n"
        "print(ctx.tokens.size, h.hexdigest())\n"
    )
    digests = []
    for threads in ("1", "4"):
        env = {**os.environ, "OPID_BB_THREADS": threads}
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
        assert res.returncode == 0, res.stderr
        digests.append(res.stdout.split())
    assert int(digests[0][0]) > 4 * 262_144  # enough work for 4 workers
    assert digests[0] == digests[1]


def test_pair_positions_name_bad_pairs():
    from opid_mega.batching import build_fork_batches, flatten_contexts

    # two samples: (orig, skill) each, in separate micro-batches with a budget of one sample
    samples = [[([1, 2, 3, 9, 8], 2), ([1, 7, 2, 3, 9, 8], 2)], [([4, 5, 6, 6], 1), ([4, 5, 0, 6, 6], 1)]]
    pb = build_fork_batches(flatten_contexts(samples), 11)
    assert pb.micro_batches_per_rank == 2
    per_mb, starts = pb.pair_positions([[1, 0], [3, 2]])
    assert [len(a) for a, _ in per_mb] == [2, 1] and starts.tolist() == [0, 0]
    for k, (a, b) in enumerate(per_mb):
        mb = pb.micro_batch(0, k)
        assert mb.gather_targets[a].tolist() == mb.gather_targets[b].tolist()
    with pytest.raises(ValueError, match="responses of 2 and 1 tokens"):
        pb.pair_positions([[1, 2]])
    with pytest.raises(ValueError, match=r"context indices must lie in \[0, 4\)"):
        pb.pair_positions([[1, 4]])
    one_mb = build_fork_batches(flatten_contexts([samples[0], [([4, 5, 6, 6, 1], 2)]]), 11)
    with pytest.raises(ValueError, match="spans two micro-batches"):
        one_mb.pair_positions([[1, 2]])
