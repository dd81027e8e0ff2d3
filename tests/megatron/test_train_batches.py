"""PPO micro-batches from the C++ batch builder (opid_mega.megatron.policy.TrainData) against the definition: every
response token of every sample is scored exactly once, from the hidden row of the token before it, with its own
old log-prob / advantage / reference log-prob; sequences stay whole; budgets and rank balance hold."""
import numpy as np
import pytest
import torch

from opid_mega.megatron.policy import TrainData


def _data(seed, n=23, max_prompt=40, max_resp=12, with_ref=True):
    rng = np.random.default_rng(seed)
    seqs, resp = [], []
    for _ in range(n):
        p, r = int(rng.integers(1, max_prompt)), int(rng.integers(0, max_resp))
        seqs.append(rng.integers(0, 50_000, p + r).tolist())
        resp.append(r)
    total = sum(resp)
    # values that name their token: sample s, response position j -> s * 1000 + j (exact in float32)
    sid = np.repeat(np.arange(n), resp)
    pos = np.concatenate([np.arange(r) for r in resp]) if total else np.zeros(0, np.int64)
    code = (sid * 1000 + pos).astype(np.float32)
    values = dict(old_logprobs=code, advantages=-code - 0.5)
    if with_ref:
        values["ref_logprobs"] = code + 0.25
    return seqs, resp, TrainData.from_sequences(seqs, resp, **values)


def _check(seqs, resp, batches_by_rank, budget, samples=None):
    """`samples`: the sample ids the batches hold (default: all)."""
    seen = set()
    counts = {len(b) for b in batches_by_rank}
    assert len(counts) == 1, "every rank gets the same number of micro-batches"
    for batches in batches_by_rank:
        for b in batches:
            ids, posn = b.input_ids[0].tolist(), b.position_ids[0].tolist()
            n = len(ids)
            assert b.cu_seqlens[0] == 0 and int(b.cu_seqlens[-1]) == n
            if not b.scored_per_seq:  # an empty micro-batch scores nothing
                assert b.score_rows.numel() == 0
                continue
            assert n <= max(budget, max(len(seqs[s]) for s in (samples or range(len(seqs)))))
            old = b.extras["old_logprobs"].tolist()
            assert sum(b.scored_per_seq) == len(old) == b.score_rows.numel() == b.score_targets.numel()
            assert b.extras["advantages"].tolist() == [-v - 0.5 for v in old]
            if "ref_logprobs" in b.extras:
                assert b.extras["ref_logprobs"].tolist() == [v + 0.25 for v in old]
            assert b.extras["loss_mask"].tolist() == [1.0] * len(old)
            start = 0
            for cnt in b.scored_per_seq:  # one sample per split, its tokens in order
                part = [divmod(int(v), 1000) for v in old[start:start + cnt]]
                assert len({s for s, _ in part}) <= 1 and [j for _, j in part] == list(range(cnt))
                start += cnt
            for row, tgt, v in zip(b.score_rows.tolist(), b.score_targets.tolist(), old):
                s, j = divmod(int(v), 1000)
                assert (s, j) not in seen
                seen.add((s, j))
                p = len(seqs[s]) - resp[s]
                assert tgt == seqs[s][p + j]
                assert ids[row] == seqs[s][p + j - 1] and posn[row] == p + j - 1
                assert ids[row + 1] == tgt  # the next packed token is the target: the sequence is whole there
    samples = range(len(resp)) if samples is None else samples
    assert seen == {(s, j) for s in samples for j in range(resp[s])}


@pytest.mark.parametrize("seed,budget,ranks", [(0, 64, 1), (1, 100, 2), (2, 37, 3), (3, 4096, 4)])
def test_micro_batches_score_every_response_token_once(seed, budget, ranks):
    seqs, resp, data = _data(seed)
    by_rank = [data.micro_batches(budget, ranks, r) for r in range(ranks)]
    _check(seqs, resp, by_rank, budget)


def test_backends_give_identical_batches():
    _, _, data = _data(4)
    a, b = data.micro_batches(80, 2, 1, backend="cpp"), data.micro_batches(80, 2, 1, backend="python")
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.score_rows, y.score_rows)
        assert x.scored_per_seq == y.scored_per_seq
        assert all(torch.equal(x.extras[k], y.extras[k]) for k in x.extras)


def test_subset_equals_building_from_the_subset():
    seqs, resp, data = _data(5, with_ref=False)
    idx = [7, 0, 19, 19, 3]  # a repeated index gives the sample twice
    sub = data.subset(idx)
    code = data.values["old_logprobs"]
    off = np.concatenate([[0], np.cumsum(resp)])
    want = TrainData.from_sequences([seqs[i] for i in idx], [resp[i] for i in idx],
                                    old_logprobs=np.concatenate([code[off[i]:off[i + 1]] for i in idx]),
                                    advantages=np.concatenate([-code[off[i]:off[i + 1]] - 0.5 for i in idx]))
    assert np.array_equal(sub.tokens, want.tokens) and np.array_equal(sub.seq_offsets, want.seq_offsets)
    assert np.array_equal(sub.resp_lens, want.resp_lens)
    assert all(np.array_equal(sub.values[k], want.values[k]) for k in want.values)
    assert "ref_logprobs" not in sub.values
    once = data.subset([7, 0, 19, 3])  # values still name the original samples
    _check(seqs, resp, [once.micro_batches(50)], 50, samples=[7, 0, 19, 3])


def test_a_rank_without_samples_gets_an_empty_micro_batch():
    seqs, resp, data = _data(6, n=1)
    by_rank = [data.micro_batches(1000, 3, r) for r in range(3)]
    assert sum(int(b.score_rows.numel()) for bs in by_rank for b in bs) == resp[0]
    _check(seqs, resp, by_rank, 1000)
    assert [len(b) for b in by_rank] == [1, 1, 1]


def test_bad_input_names_the_problem():
    seqs = [[1, 2, 3], [4, 5]]
    ok = dict(old_logprobs=np.zeros(3, np.float32), advantages=np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="advantages"):
        TrainData.from_sequences(seqs, [2, 1], old_logprobs=np.zeros(3, np.float32))
    with pytest.raises(ValueError, match=r"old_logprobs has shape \(4,\)"):
        TrainData.from_sequences(seqs, [2, 1], old_logprobs=np.zeros(4, np.float32), advantages=np.zeros(3))
    with pytest.raises(ValueError, match="sample 1: resp_len 2"):
        TrainData.from_sequences(seqs, [1, 2], **ok)
    with pytest.raises(ValueError, match="unknown value"):
        TrainData.from_sequences(seqs, [2, 1], **ok, rewards=np.zeros(3))
    with pytest.raises(ValueError, match="token ids"):
        TrainData.from_sequences([[1, -2, 3], [4, 5]], [2, 1], **ok)
    data = TrainData.from_sequences(seqs, [2, 1], **ok)
    with pytest.raises(IndexError, match=r"\[0, 2\)"):
        data.subset([2])
    with pytest.raises(ValueError, match="rank 2"):
        data.micro_batches(10, 2, 2)


# ------------------------------------------------------------------------------------ distillation (skill contexts)
def _skill_data(seed, n=17):
    """Samples with 0-2 skill contexts each: a section inserted at a random point of the prompt; the old log-prob
    names its token (sample * 1000 + position)."""
    rng = np.random.default_rng(seed)
    seqs, resp, skills, sections = [], [], [], []
    shared = rng.integers(0, 50_000, 9).tolist()
    for i in range(n):
        prompt = list(shared) if i % 3 == 0 else rng.integers(0, 50_000, int(rng.integers(1, 30))).tolist()
        r = int(rng.integers(1, 10))
        response = rng.integers(0, 50_000, r).tolist()
        seqs.append(prompt + response)
        resp.append(r)
        ctxs, per = [], {}
        for kind in ("episode", "step")[:int(rng.integers(0, 3))]:
            at = int(rng.integers(0, len(prompt) + 1))
            section = rng.integers(0, 50_000, int(rng.integers(1, 8))).tolist()
            per[kind] = (at, section)
            ctxs.append(prompt[:at] + section + prompt[at:] + response)
        skills.append(ctxs)
        sections.append(per)
    code = np.concatenate([s * 1000 + np.arange(r) for s, r in enumerate(resp)]).astype(np.float32)
    return seqs, resp, skills, TrainData.from_sequences(seqs, resp, skills=sections, old_logprobs=code,
                                                        advantages=-code - 0.5), sections


def _visible(b, row):
    """The token ids row `row` attends to (its own context up to itself), by the fork attention rule."""
    ids, br, cu = b.input_ids[0].tolist(), b.branch_ids.tolist(), b.cu_seqlens.tolist()
    g = max(i for i in range(len(cu) - 1) if cu[i] <= row)
    return [ids[j] for j in range(cu[g], row + 1) if br[j] == 0 or br[j] == br[row]]


@pytest.mark.parametrize("seed,budget,ranks", [(0, 64, 1), (1, 200, 2), (2, 1, 3)])
def test_skill_context_batches_pair_every_skill_token_with_its_original_token(seed, budget, ranks):
    seqs, resp, skills, data, _ = _skill_data(seed)
    per_rank = [data.micro_batches(budget, ranks, r) for r in range(ranks)]
    assert len({len(b) for b in per_rank}) == 1
    orig_seen, pair_seen = set(), set()
    for b in (b for batches in per_rank for b in batches):
        if b.score_rows.numel() == 0:
            continue
        old, mask = b.extras["old_logprobs"].tolist(), b.extras["loss_mask"].tolist()
        assert b.extras["advantages"].tolist() == [(-v - 0.5) if m else 0.0 for v, m in zip(old, mask)]
        assert sum(b.scored_per_seq) == len(old)
        rows, tgts = b.score_rows.tolist(), b.score_targets.tolist()
        for i, m in enumerate(mask):
            if m:  # an original-context token: its own sample's prompt + response before it
                s, j = divmod(int(old[i]), 1000)
                assert (s, j) not in orig_seen
                orig_seen.add((s, j))
                p = len(seqs[s]) - resp[s]
                assert tgts[i] == seqs[s][p + j] and _visible(b, rows[i]) == seqs[s][:p + j]
            else:
                assert old[i] == 0.0
        for sp, op in zip(*b.pairs.tolist()):
            assert mask[op] == 1.0 and mask[sp] == 0.0 and tgts[sp] == tgts[op]
            s, j = divmod(int(old[op]), 1000)
            seen_ctx = _visible(b, rows[sp])
            match = [c for c, ctx in enumerate(skills[s]) if ctx[:len(ctx) - resp[s] + j] == seen_ctx]
            assert match, "a skill row sees one of its sample's skill contexts"
            pair_seen.add((s, match[0], j))
    assert orig_seen == {(s, j) for s, r in enumerate(resp) for j in range(r)}
    assert pair_seen == {(s, c, j) for s, r in enumerate(resp) for c in range(len(skills[s])) for j in range(r)}


def test_skill_contexts_follow_subset_and_bad_ones_are_named():
    seqs, resp, skills, data, sections = _skill_data(5)
    idx = [4, 0, 9]
    sub = data.subset(idx)
    want = TrainData.from_sequences([seqs[i] for i in idx], [resp[i] for i in idx],
                                    skills=[sections[i] for i in idx],
                                    old_logprobs=sub.values["old_logprobs"], advantages=sub.values["advantages"])
    for k in ("tokens", "seq_offsets", "resp_lens", "skill_offsets", "insert_at", "section_offsets",
              "section_tokens"):
        assert np.array_equal(getattr(sub, k), getattr(want, k)), k
    ctx = sub.contexts()  # the subset's contexts are those of its samples, built from the insertion points
    got = [ctx.tokens[ctx.ctx_offsets[c]:ctx.ctx_offsets[c + 1]].tolist() for c in range(ctx.num_contexts)]
    assert got == [c for i in idx for c in [seqs[i], *skills[i]]]
    z = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match=r"insert_at\[0\]=2 lies outside the prompt of sample 0 \(0..1\)"):
        TrainData.from_sequences([[1, 2, 3, 4]], [3], skills=[{"step": (2, [7])}], old_logprobs=z, advantages=z)
    with pytest.raises(ValueError, match="skills has 2 entries for 1 samples"):
        TrainData.from_sequences([[1, 2, 3, 4]], [3], skills=[{}, {}], old_logprobs=z, advantages=z)
    with pytest.raises(ValueError, match="together"):
        TrainData(np.array([1, 2, 3, 4]), np.array([0, 4]), np.array([3]), dict(old_logprobs=z, advantages=z),
                  skill_offsets=np.array([0, 1]))
    with pytest.raises(ValueError, match=r"section_offsets\[-1\]=3 must equal the number of section tokens \(2\)"):
        TrainData(np.array([1, 2, 3, 4]), np.array([0, 4]), np.array([3]), dict(old_logprobs=z, advantages=z),
                  skill_offsets=np.array([0, 1]), insert_at=np.array([1]), section_offsets=np.array([0, 3]),
                  section_tokens=np.array([5, 6]))
    # no sample with a skill context: the plain layout (no pairs) as before
    plain = TrainData.from_sequences([[1, 2, 3, 4]], [3], skills=[{}], old_logprobs=z, advantages=z)
    assert not plain.has_skills and plain.micro_batches(64)[0].pairs is None
