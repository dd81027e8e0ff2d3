"""Fork layout (numpy reference): equivalence with naive per-context scoring, edge cases, unpacking."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "batching"))
from batch_builder_helpers import context_batches  # noqa: E402

from opid_mega.batching import build_fork_batches  # noqa: E402
from opid_mega.batching.layout import flatten_contexts, sample_prefix_lengths, unpack_logprobs  # noqa: E402


def visible_context(mb, row):
    """(tokens, positions) that `row` attends to under the fork rule, in order."""
    cu = mb.cu_seqlens
    g = int(np.searchsorted(cu, row, side="right")) - 1
    start = int(cu[g])
    j = np.arange(start, row + 1)
    b = mb.branch_ids
    keep = (b[j] == 0) | (b[j] == b[row])
    return mb.tokens[j[keep]], mb.position_ids[j[keep]]


def check_equivalent(ctx, packed):
    """Every gathered row sees exactly the naive context before its target, at the naive positions."""
    seen = 0
    for rank in range(packed.num_ranks):
        for mb in packed.micro_batches(rank):
            assert mb.cu_seqlens[-1] == mb.tokens.size
            for m in range(mb.gather_rows.size):
                seen += 1
    assert seen == int(ctx.resp_lens.sum())
    flat_rows = []
    for rank in range(packed.num_ranks):
        for mb in packed.micro_batches(rank):
            flat_rows.append([(mb, int(r), int(t)) for r, t in zip(mb.gather_rows, mb.gather_targets)])
    flat_rows = [x for part in flat_rows for x in part]
    per = unpack_logprobs(np.arange(len(flat_rows)), packed.flat["ctx_gather_start"], ctx.resp_lens,
                          ctx.sample_offsets)
    for s in range(ctx.num_samples):
        for i, c in enumerate(range(ctx.sample_offsets[s], ctx.sample_offsets[s + 1])):
            full = ctx.tokens[ctx.ctx_offsets[c]:ctx.ctx_offsets[c + 1]]
            r = int(ctx.resp_lens[c])
            idx = per[s][i]
            assert idx.size == r
            for k, m in enumerate(idx):
                mb, row, target = flat_rows[int(m)]
                q = full.size - r + k  # naive position of the target
                toks, pos = visible_context(mb, row)
                assert target == full[q]
                np.testing.assert_array_equal(pos, np.arange(q))
                np.testing.assert_array_equal(toks, full[:q])


@settings(max_examples=60, deadline=None)
@given(context_batches())
def test_fork_layout_equals_naive_contexts(ctx):
    packed = build_fork_batches(ctx, budget=10_000, num_ranks=2, backend="python")
    check_equivalent(ctx, packed)
    assert packed.num_tokens <= ctx.tokens.size


def test_edge_cases_and_sharing():
    pre, tail, skill = [11, 12, 13, 14], [21, 22], [31, 32, 33]
    samples = [
        [(pre + tail + [1, 2], 2), (pre + skill + tail + [1, 2], 2)],          # normal
        [(pre + [3], 1), (pre + skill + [3], 1)],                              # empty tail, 1-token response
        [(pre + tail + [4, 5], 2), (pre + tail + [4, 5], 2)],                  # empty skill (identical contexts)
        [(pre + tail, 0), (pre + skill + tail, 0)],                            # empty responses
        [(pre, 0), (pre + tail + [6], 1)],                                     # a context that is a prefix of another
        [(pre + tail + [1, 2], 2), (pre + skill + tail + [1, 2], 2), (pre + [9] + tail + [1, 2], 2)],  # 3 contexts
        [([7], 0)],                                                            # one token, no response
    ]
    ctx = flatten_contexts(samples)
    prefix = sample_prefix_lengths(ctx.tokens, ctx.ctx_offsets, ctx.resp_lens, ctx.sample_offsets)
    assert prefix.tolist() == [4, 4, 6, 4, 4, 4, 1]
    packed = build_fork_batches(ctx, budget=1000, backend="python")
    check_equivalent(ctx, packed)
    # samples 0, 1, 3, 4, 5 share the prefix [11..14] -> one group; sample 2's own prefix is longer.
    f = packed.flat
    groups = [f["group_samples"][f["group_sample_offsets"][g]:f["group_sample_offsets"][g + 1]].tolist()
              for g in range(len(f["group_prefix_lens"]))]
    assert groups == [[0, 1, 3, 4, 5], [2], [6]]
    assert packed.shared_fraction > 0.3
    no_share = build_fork_batches(ctx, budget=1000, share_prompts=False, backend="python")
    check_equivalent(ctx, no_share)
    assert no_share.num_tokens > packed.num_tokens


def test_first_response_token_predicted_by_prefix_last_row():
    # identical prompts, different responses: both branches start with their response
    ctx = flatten_contexts([[([5, 6, 7, 1, 2], 2)], [([5, 6, 7, 3], 1)]])
    packed = build_fork_batches(ctx, budget=100, backend="python")
    mb = packed.micro_batch(0, 0)
    assert mb.tokens.tolist() == [5, 6, 7, 1, 2, 3]
    assert mb.branch_ids.tolist() == [0, 0, 0, 1, 1, 2]
    assert mb.position_ids.tolist() == [0, 1, 2, 3, 4, 3]
    assert mb.gather_rows.tolist() == [2, 3, 2]   # row 2 (prefix end) predicts both first response tokens
    assert mb.gather_targets.tolist() == [1, 2, 3]
    out = packed.unpack_logprobs(np.array([0.1, 0.2, 0.3]))
    assert [[a.tolist() for a in s] for s in out] == [[[0.1, 0.2]], [[0.3]]]


def test_sample_larger_than_budget_is_named():
    ctx = flatten_contexts([[([1, 2, 3], 1)], [([1, 2, 3, 4, 5, 6, 7], 2)]])
    with pytest.raises(ValueError, match="sample 1 needs 7 tokens"):
        build_fork_batches(ctx, budget=5, backend="python")


def _toy_logprobs(params, tokens, positions, mask):
    """One causal attention layer + output head in float64; `mask[i, j]` True where i may attend j."""
    emb, pos_emb, wq, wk, wv, wo = params
    x = emb[tokens] + pos_emb[positions]
    q, k, v = x @ wq, x @ wk, x @ wv
    att = (q @ k.T) / np.sqrt(q.shape[-1])
    att = att.masked_fill(~mask, float("-inf")).softmax(-1)
    h = x + att @ v
    return torch.log_softmax(h @ wo, dim=-1)


@pytest.mark.parametrize("seed", [0, 1])
def test_fork_layout_logprobs_equal_naive_passes_float64(seed):
    """A real (toy) attention model: fork-layout log-probs == per-context naive log-probs (float64)."""
    rng = np.random.default_rng(seed)
    vocab, dim = 17, 8
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(vocab, dim, generator=g, dtype=torch.float64),
              torch.randn(64, dim, generator=g, dtype=torch.float64)]
    params += [torch.randn(dim, dim, generator=g, dtype=torch.float64) for _ in range(3)]
    params += [torch.randn(dim, vocab, generator=g, dtype=torch.float64)]
    shared = rng.integers(0, vocab, 6).tolist()
    samples = []
    for s in range(4):
        pre = shared if s < 2 else rng.integers(0, vocab, 5).tolist()
        tail = rng.integers(0, vocab, int(rng.integers(0, 3))).tolist()
        resp = rng.integers(0, vocab, int(rng.integers(1, 5))).tolist()
        skill = rng.integers(0, vocab, int(rng.integers(0, 4))).tolist()
        samples.append([(pre + tail + resp, len(resp)), (pre + skill + tail + resp, len(resp))])
    ctx = flatten_contexts(samples)
    packed = build_fork_batches(ctx, budget=200, backend="python")
    gathered = []
    for mb in packed.micro_batches(0):
        t = torch.as_tensor(mb.tokens)
        b = torch.as_tensor(mb.branch_ids)
        seg = torch.as_tensor(np.searchsorted(mb.cu_seqlens, np.arange(mb.tokens.size), side="right"))
        n = t.numel()
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        mask = (j <= i) & (seg[:, None] == seg[None, :]) & ((b[None, :] == 0) | (b[None, :] == b[:, None]))
        lp = _toy_logprobs(params, t, torch.as_tensor(mb.position_ids), mask)
        gathered.append(lp[torch.as_tensor(mb.gather_rows), torch.as_tensor(mb.gather_targets)].numpy())
    per = packed.unpack_logprobs(gathered)
    for s, contexts in enumerate(samples):
        for c, (toks, r) in enumerate(contexts):
            t = torch.as_tensor(toks)
            n = t.numel()
            mask = torch.ones(n, n, dtype=torch.bool).tril()
            lp = _toy_logprobs(params, t, torch.arange(n), mask)
            ref = lp[torch.arange(n - r - 1, n - 1), t[n - r:]].numpy()
            np.testing.assert_allclose(per[s][c], ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_skill_contexts_insert_each_section_at_its_point(seed):
    from opid_mega.batching.layout import csr_offsets, skill_contexts

    rng = np.random.default_rng(seed)
    seqs, plens, per, at, secs = [], [], [], [], []
    for _ in range(int(rng.integers(1, 12))):
        p, r = int(rng.integers(1, 9)), int(rng.integers(0, 6))
        seqs.append(rng.integers(1, 90_000, p + r).tolist())
        plens.append(p)
        k = int(rng.integers(0, 3))
        per.append(k)
        for _ in range(k):
            at.append(int(rng.integers(0, p + 1)))
            secs.append(rng.integers(1, 90_000, int(rng.integers(0, 5))).tolist())
    ctx = skill_contexts(np.concatenate([np.array(s, np.int32) for s in seqs]), csr_offsets(list(map(len, seqs))),
                         plens, csr_offsets(per), at, csr_offsets(list(map(len, secs))),
                         np.array([t for s in secs for t in s], np.int32))
    want, resp, e = [], [], 0
    for s, (seq, p, k) in enumerate(zip(seqs, plens, per)):
        want.append(seq)
        for _ in range(k):  # prompt[:at] + section + prompt[at:] + response, by hand
            want.append(seq[:at[e]] + secs[e] + seq[at[e]:])
            e += 1
        resp += [len(seq) - p] * (1 + k)
    got = [ctx.tokens[ctx.ctx_offsets[c]:ctx.ctx_offsets[c + 1]].tolist() for c in range(ctx.num_contexts)]
    assert got == want and ctx.resp_lens.tolist() == resp and ctx.tokens.dtype == np.int32
    assert ctx.sample_offsets.tolist() == csr_offsets([1 + k for k in per]).tolist()


def test_skill_contexts_name_bad_columns():
    from opid_mega.batching.layout import skill_contexts

    tok, off = np.array([5, 6, 7], np.int32), np.array([0, 3])
    ok = dict(tokens=tok, seq_offsets=off, prompt_lens=[2], skill_offsets=[0, 1], insert_at=[1],
              section_offsets=[0, 2], section_tokens=np.array([8, 9], np.int32))
    assert skill_contexts(**ok).tokens.tolist() == [5, 6, 7, 5, 8, 9, 6, 7]
    for change, match in [(dict(insert_at=[3]), r"insert_at\[0\]=3 lies outside the prompt of sample 0 \(0..2\)"),
                          (dict(insert_at=[-1]), r"insert_at\[0\]=-1"),
                          (dict(prompt_lens=[0]), r"prompt_lens\[0\]=0 must be in \[1, 3\]"),
                          (dict(prompt_lens=[2, 1]), r"prompt_lens has shape \(2,\), expected \(1,\)"),
                          (dict(skill_offsets=[0, 2]), r"insert_at has shape \(1,\), expected \(2,\)"),
                          (dict(section_offsets=[0, 3]), r"section_offsets\[-1\]=3 must equal"),
                          (dict(seq_offsets=[0, 4]), r"seq_offsets\[-1\]=4 must equal the number of tokens \(3\)"),
                          (dict(tokens=tok.astype(np.float32)), "dtype int32 or int64")]:
        with pytest.raises((ValueError, TypeError), match=match):
            skill_contexts(**{**ok, **change})
