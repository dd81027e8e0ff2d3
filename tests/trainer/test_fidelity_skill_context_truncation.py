"""algo.truncate_skill_context: the augmented prompt left-truncated to max_prompt_length, as the reference does.

Reference (jinyangwu/OPID): `agent_system/multi_turn_rollout/rollout_loop.py:74-76` (`build_text_prompt_sample`,
which rebuilds the skill-augmented teacher prompt for scoring): the chat-templated prompt is encoded and, when longer
than `data.max_prompt_length`, cut with `data.truncation`; "left" keeps `raw_prompt_ids[-max_prompt_length:]`, its
LAST max_prompt_length tokens (the model inputs come from `tokenize_and_postprocess_data` with the same
truncation). The paper's scripts set `data.truncation=left` (e.g. `examples/opid_trainer/run_alfworld_opid_guide.sh`).
So the teacher context is `(prompt[:at] + section + prompt[at:])[-max_prompt_length:] + response`: the leading
`len(prompt) + len(section) - max_prompt_length` tokens go, whichever piece they come from.

Expected values below are written by hand from that rule; the scorers and the training view must agree with it, and
the naive and fork scorers must agree on truncated contexts (a float64 toy attention model)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from opid_mega.batching import build_fork_batches
from opid_mega.batching.layout import csr_offsets, sample_prefix_lengths, skill_contexts
from opid_mega.config import load_config
from opid_mega.experience import Experience, add_skills
from opid_mega.megatron.policy import TrainData
from opid_mega.rollout.types import RolloutBatch, StepSample, Trajectory
from opid_mega.scoring.scorer import ForkScorer
from opid_mega.scoring.scorer import NaiveScorer, ScoreRequest, context_batch, score_requests
from opid_mega.skills.types import Analysis
from tolerance import tolerance_for


def reference_context(prompt, at, section, response, max_prompt_length):
    """The reference's teacher context: the augmented prompt, left-truncated (its last max_prompt_length tokens)."""
    augmented = list(prompt[:at]) + list(section) + list(prompt[at:])
    if len(augmented) > max_prompt_length:
        augmented = augmented[-max_prompt_length:]
    return augmented + list(response)


def contexts_of(ctx):
    return [ctx.tokens[ctx.ctx_offsets[c]:ctx.ctx_offsets[c + 1]].tolist() for c in range(ctx.num_contexts)]


# ---- the layout: drop cuts leading tokens across head, section and rest ------------------------------------------
def test_drop_by_hand():
    # prompt [1 2 3 4 5], response [90 91], section [7 8 9] inserted before token 2: augmented = 1 2 7 8 9 3 4 5
    seq = np.array([1, 2, 3, 4, 5, 90, 91], np.int32)
    ctx = skill_contexts(seq, [0, 7], [5], [0, 4], [2, 2, 2, 2], csr_offsets([3] * 4),
                         np.array([7, 8, 9] * 4, np.int32), drop=[0, 1, 4, 7])
    assert contexts_of(ctx) == [[1, 2, 3, 4, 5, 90, 91],
                                [1, 2, 7, 8, 9, 3, 4, 5, 90, 91],
                                [2, 7, 8, 9, 3, 4, 5, 90, 91],  # from the head
                                [9, 3, 4, 5, 90, 91],  # head and part of the section
                                [5, 90, 91]]  # into the rest: one prompt token left
    assert ctx.resp_lens.tolist() == [2] * 5


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_drop_equals_the_reference_left_truncation(seed):
    rng = np.random.default_rng(seed)
    seqs, plens, per, at, secs, want, limits = [], [], [], [], [], [], []
    for _ in range(int(rng.integers(1, 10))):
        p, r = int(rng.integers(1, 12)), int(rng.integers(0, 5))
        seq = rng.integers(1, 90_000, p + r).tolist()
        seqs.append(seq)
        plens.append(p)
        want.append(seq)
        k = int(rng.integers(0, 3))
        per.append(k)
        for _ in range(k):
            a, sec = int(rng.integers(0, p + 1)), rng.integers(1, 90_000, int(rng.integers(0, 6))).tolist()
            m = int(rng.integers(1, p + len(sec) + 2))  # max_prompt_length: from 1 to more than the augmented prompt
            at.append(a)
            secs.append(sec)
            limits.append(max(0, p + len(sec) - m))
            want.append(reference_context(seq[:p], a, sec, seq[p:], m))
    ctx = skill_contexts(np.concatenate([np.array(s, np.int32) for s in seqs]), csr_offsets(list(map(len, seqs))),
                         plens, csr_offsets(per), at, csr_offsets(list(map(len, secs))),
                         np.array([t for s in secs for t in s], np.int32), drop=limits)
    assert contexts_of(ctx) == want
    assert ctx.resp_lens.tolist() == [len(s) - p for s, p, k in zip(seqs, plens, per) for _ in range(1 + k)]


def test_bad_drop_is_named():
    ok = dict(tokens=np.array([5, 6, 7], np.int32), seq_offsets=[0, 3], prompt_lens=[2], skill_offsets=[0, 1],
              insert_at=[1], section_offsets=[0, 2], section_tokens=np.array([8, 9], np.int32))
    for drop, match in [([4], r"drop\[0\]=4 must be in \[0, 3\]"), ([-1], r"drop\[0\]=-1"),
                        ([0, 0], r"drop has shape \(2,\), expected \(1,\)")]:
        with pytest.raises(ValueError, match=match):
            skill_contexts(**ok, drop=drop)
    with pytest.raises(ValueError, match="drop given for 'step', which has no skill context"):
        ScoreRequest([1, 2], [3], {"episode": (1, [8])}, {"step": 1})
    with pytest.raises(ValueError, match=r"drop\['episode'\]=3 must leave at least one prompt token \(0..2\)"):
        ScoreRequest([1, 2], [3], {"episode": (1, [8])}, {"episode": 3})


# ---- the experience stage: drop = max(0, prompt + section - rollout.max_prompt_tokens) ---------------------------
def _batch():
    rng = np.random.default_rng(7)
    trajs = []
    for j in range(3):
        steps = []
        for k in range(2):
            p = int(rng.integers(6, 12))
            prompt, resp = rng.integers(1, 900, p).tolist(), rng.integers(1, 900, 3).tolist()
            steps.append(StepSample(task_id=f"t{j}", group_id=j, traj_id=j, step=k, prompt_text="p", prompt_ids=prompt,
                                    episode_insert_at=2, step_insert_at=p - 1, response_ids=resp,
                                    response_logprobs=[-0.5] * 3, response_text="r", finish_reason="stop",
                                    action="go", valid=True, raw_obs="o", reward=0.0, done=False))
        trajs.append(Trajectory(task_id=f"t{j}", group_id=j, traj_id=j, steps=steps, won=bool(j % 2), score=float(j)))
    return RolloutBatch(trajectories=trajs)


def _fit(skill, kind):
    return skill, [7000 + len(skill)] * len(skill.split())  # one id per word


ANALYSES = [Analysis("sum", "a b c d", {0: "x y"}), Analysis("sum", "one", {}),
            Analysis("sum", "e f g h i j k", {1: "z"})]


@pytest.mark.parametrize("truncate", [False, True])
def test_add_skills_cuts_what_the_reference_cuts(truncate):
    limit = 9  # rollout.max_prompt_tokens; prompts are 6..11 tokens, sections 1..7: some augmented prompts exceed it
    exp = Experience.from_rollout(_batch(), iteration=1, policy_version=0)
    cfg = load_config(None, [f"algo.truncate_skill_context={str(truncate).lower()}"]).algo
    add_skills(exp, ANALYSES, cfg, _fit, max_prompt_tokens=limit)
    want, cut = [], 0
    for i, s in enumerate(exp.steps):
        want.append(s.prompt_ids + s.response_ids)
        for kind, (at, sec) in sorted(exp.contexts(i).items()):
            full = s.prompt_ids[:at] + sec + s.prompt_ids[at:] + s.response_ids
            ref = reference_context(s.prompt_ids, at, sec, s.response_ids, limit)
            want.append(ref if truncate else full)
            cut += ref != full
    assert cut > 0  # the case is exercised
    scored = exp.scoring_contexts()
    teacher = TrainData(exp.tokens, exp.seq_offsets, exp.resp_lens,
                        dict(old_logprobs=np.zeros(int(exp.resp_lens.sum())),
                             advantages=np.zeros(int(exp.resp_lens.sum()))), **exp.skill_columns())
    assert contexts_of(scored) == want and contexts_of(teacher.contexts()) == want
    # the training view's subsets keep each context's cut
    idx = np.array([5, 0, 3])
    sub = teacher.subset(idx)
    own = csr_offsets(1 + np.diff(exp.skill_offsets))  # each sample's contexts in `want`
    per = [want[int(own[i]):int(own[i + 1])] for i in idx]
    assert contexts_of(sub.contexts()) == [c for p in per for c in p]
    if not truncate:
        assert not exp.skill_drop.any()


def test_add_skills_needs_the_limit_when_truncating():
    exp = Experience.from_rollout(_batch(), iteration=1, policy_version=0)
    cfg = load_config(None, ["algo.truncate_skill_context=true"]).algo
    with pytest.raises(ValueError, match="algo.truncate_skill_context needs max_prompt_tokens"):
        add_skills(exp, ANALYSES, cfg, _fit)
    add_skills(exp, ANALYSES, load_config(None, []).algo, _fit)  # off (the default): no limit needed
    assert exp.skill_drop.size == len(exp.skill_kinds) and not exp.skill_drop.any()


# ---- the scorers agree on truncated contexts ---------------------------------------------------------------------
VOCAB, DIM = 23, 8


def _params(seed):
    g = torch.Generator().manual_seed(seed)
    p = [torch.randn(VOCAB, DIM, generator=g, dtype=torch.float64),
         torch.randn(64, DIM, generator=g, dtype=torch.float64)]
    p += [torch.randn(DIM, DIM, generator=g, dtype=torch.float64) / 2 for _ in range(3)]
    return p + [torch.randn(DIM, VOCAB, generator=g, dtype=torch.float64)]


def _toy_logprobs(params, tokens, positions, mask, temperature):
    """One causal attention layer + output head in float64; `mask[i, j]` True where i may attend j."""
    emb, pos_emb, wq, wk, wv, wo = params
    x = emb[tokens] + pos_emb[positions]
    att = ((x @ wq) @ (x @ wk).T / np.sqrt(DIM)).masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.log_softmax((x + att @ (x @ wv)) @ wo / temperature, dim=-1)


def _naive_fn(params):
    def fn(seqs, temperature=1.0):
        out = []
        for toks, start in seqs:
            t = torch.as_tensor(toks)
            n = t.numel()
            lp = _toy_logprobs(params, t, torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril(), temperature)
            out.append(lp[torch.arange(start - 1, n - 1), t[start:]].float())
        return out
    return fn


def _packed_fn(params):
    def fn(mbs, temperature=1.0):
        out = []
        for mb in mbs:
            t, b = torch.as_tensor(mb.tokens).long(), torch.as_tensor(mb.branch_ids)
            seg = torch.as_tensor(np.searchsorted(mb.cu_seqlens, np.arange(mb.tokens.size), side="right"))
            i, j = torch.arange(t.numel())[:, None], torch.arange(t.numel())[None, :]
            mask = (j <= i) & (seg[:, None] == seg[None, :]) & ((b[None, :] == 0) | (b[None, :] == b[:, None]))
            lp = _toy_logprobs(params, t, torch.as_tensor(mb.position_ids).long(), mask, temperature)
            out.append(lp[torch.as_tensor(mb.gather_rows).long(), torch.as_tensor(mb.gather_targets).long()].float())
        return out
    return fn


def _requests(seed, limit):
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, VOCAB, 9).tolist()
    reqs = []
    for s in range(6):
        prompt = shared if s < 3 else rng.integers(0, VOCAB, int(rng.integers(4, 12))).tolist()
        resp = rng.integers(0, VOCAB, int(rng.integers(1, 5))).tolist()
        skills, drop = {}, {}
        for kind in (("episode", "step") if s % 2 else ("episode",)):
            sec = rng.integers(0, VOCAB, int(rng.integers(1, 6))).tolist()
            skills[kind] = (int(rng.integers(0, len(prompt) + 1)), sec)
            d = max(0, len(prompt) + len(sec) - limit)  # experience.add_skills' rule
            if d:
                drop[kind] = d
        reqs.append(ScoreRequest(prompt, resp, skills, drop))
    return reqs


@pytest.mark.parametrize("backend", ["cpp", "python"])
@pytest.mark.parametrize("seed", [0, 1])
def test_naive_and_fork_scorers_agree_on_truncated_contexts(seed, backend, monkeypatch):
    import opid_mega.batching as batching

    if backend == "python":
        monkeypatch.setattr(batching, "_C", None)
        monkeypatch.setattr(batching, "_WARNED", True)
    elif batching._C is None:
        pytest.skip("opid_mega._C is not built")
    limit = 10
    reqs = _requests(seed, limit)
    assert sum(len(r.drop) for r in reqs) >= 2  # truncated contexts are present
    params = _params(seed)
    naive = score_requests(NaiveScorer(_naive_fn(params), temperature=0.7), reqs)
    fork = ForkScorer(_packed_fn(params), max_tokens=400, temperature=0.7)
    got = score_requests(fork, reqs)
    # float64 reference: each context by hand (the reference's truncation) through the same toy model
    for r, a, b in zip(reqs, naive, got):
        for kind in [None, *sorted(r.skills)]:
            if kind is None:
                toks = list(r.prompt_ids) + list(r.response_ids)
            else:
                at, sec = r.skills[kind]
                toks = reference_context(r.prompt_ids, at, sec, r.response_ids, limit)
            t = torch.as_tensor(toks)
            n, m = t.numel(), len(r.response_ids)
            ref = _toy_logprobs(params, t, torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril(), 0.7)
            ref = ref[torch.arange(n - m - 1, n - 1), t[n - m:]]
            for side in (a, b):
                v = side.orig if kind is None else side.skill[kind]
                tol = tolerance_for(ref.numpy())
                assert float((v.double() - ref).abs().max()) <= tol, (kind, v, ref)
    # a truncated context no longer starts with the prompt: its sample shares no more than the common prefix
    ctx, _ = context_batch(reqs)
    pre = sample_prefix_lengths(ctx.tokens, ctx.ctx_offsets, ctx.resp_lens, ctx.sample_offsets)
    for s, c in enumerate(contexts_of(ctx)[i] for i in ctx.sample_offsets[:-1]):
        group = contexts_of(ctx)[int(ctx.sample_offsets[s]):int(ctx.sample_offsets[s + 1])]
        common = 0
        while all(len(g) > common and g[common] == group[0][common] for g in group) and \
                common < min(len(g) - len(reqs[s].response_ids) for g in group):
            common += 1
        assert pre[s] == common
    packed = build_fork_batches(ctx, 400, 1, backend=backend)
    assert int(packed.num_naive_tokens) == sum(len(c) for c in contexts_of(ctx))


def test_paper_configs_truncate_as_the_reference_and_the_default_does_not():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "configs"
    paper = sorted(root.glob("qwen*.yaml"))
    assert len(paper) == 9
    assert all(load_config(str(p), []).algo.truncate_skill_context for p in paper)
    assert not load_config(str(root / "tiny_cpu.yaml"), []).algo.truncate_skill_context
    assert not load_config(None, []).algo.truncate_skill_context
