"""algo.delta / algo.distill_coef through the Megatron model (one rank, gloo): the fork scorer's divergences and the
distillation loss's gradient against float64 references built from separate full-logit forwards of each context."""
import os

import numpy as np
import pytest
import torch

from megatron_testutil import make_hf_model
from tolerance import assert_close_scaled

from opid_mega.scoring.scorer import ScoreRequest, score_requests

pytest.importorskip("megatron.core")

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny_cpu.yaml")
T = 0.7  # a sampling temperature != 1: every log-prob and KL is of softmax(logits / T)


def _context(req, kind):
    """The tokens of one context, by hand: prompt[:at] + section + prompt[at:] + response (kind None: the original)."""
    p = list(req.prompt_ids)
    if kind is not None:
        at, section = req.skills[kind]
        p = p[:at] + list(section) + p[at:]
    return p + list(req.response_ids)


def _kl_magnitude(lo, ls):
    """Per row, Σ p_o (|log p_o| + |log p_s|): the size of the terms KL(p_o‖p_s) is summed from, which sets its fp32
    rounding (the KL itself is ~1e-2, a difference of log-probs of size ~7)."""
    return (lo.exp() * (lo.abs() + ls.abs())).sum(-1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from opid_mega.config import load_config
    from opid_mega.megatron import parallel
    from opid_mega.megatron.policy import Policy

    d = str(tmp_path_factory.mktemp("hf"))
    hf = make_hf_model("qwen3", d, layers=2)
    cfg = load_config(CONFIG, ["model.init_from=", "scoring.scorer=fork", "algo.delta=full_kl",
                               f"rollout.temperature={T}", "algo.kl_coef=0", "algo.entropy_coef=0"])
    pol = Policy(cfg, d)
    yield pol, hf.double()
    parallel.destroy_all()


def _requests():

    g = torch.Generator().manual_seed(11)
    r = lambda n: torch.randint(0, 1024, (n,), generator=g).tolist()  # noqa: E731
    shared = r(9)
    return [
        ScoreRequest(shared, r(6), {"episode": (3, r(5)), "step": (9, r(4))}),  # both kinds
        ScoreRequest(shared, r(4), {"step": (9, r(3))}),  # same prompt: one shared prefix with the first
        ScoreRequest(r(7), r(5), {}),  # no skill
        ScoreRequest(r(6), r(3), {"episode": (0, r(6))}),  # skill before the whole prompt
    ]


def _full(hf, tokens, score_from):
    """float64 log-softmax(logits / T) of the rows that predict tokens[score_from:]."""
    with torch.no_grad():
        logits = hf(torch.tensor([tokens])).logits[0].double() / T
    return torch.log_softmax(logits[score_from - 1:len(tokens) - 1], -1)


def test_fork_scorer_divergences_match_float64(setup):
    from opid_mega.scoring.scorer import ForkScorer

    pol, hf = setup
    reqs = _requests()
    plain = score_requests(ForkScorer(pol.packed_logprobs, 4096, temperature=T), reqs)
    with_div = score_requests(ForkScorer(pol.packed_logprobs, 4096, temperature=T, divergence_topk=5), reqs)
    for a, b, req in zip(plain, with_div, reqs):
        # the same log-probs (not always bit for bit: CPU GEMM paths depend on buffer alignment, which the extra
        # tensors move; algo.delta=sampled never builds them, see test_sampled_scorer_calls_the_model_as_before)
        assert_close_scaled(b.orig, a.orig, rel=1e-6, msg="orig log-probs")  # 1e-6 of the largest |log-prob|
        assert a.skill.keys() == b.skill.keys()
        for k in a.skill:
            assert_close_scaled(b.skill[k], a.skill[k], rel=1e-6, msg=f"{k} log-probs")
        assert a.divergence == {} and b.divergence.keys() == req.skills.keys()
        R = len(req.response_ids)
        orig_ctx = _context(req, None)
        lo = _full(hf, orig_ctx, len(orig_ctx) - R)
        for kind in req.skills:
            ctx = _context(req, kind)
            ls = _full(hf, ctx, len(ctx) - R)
            d = b.divergence[kind]
            kl_os = (lo.exp() * (lo - ls)).sum(-1)
            kl_so = (ls.exp() * (ls - lo)).sum(-1)
            assert kl_os.min() > 1e-3  # distinct contexts: a real divergence to match, not ~0
            # fp32 vs float64: 1e-5 of the magnitudes the KLs are summed from / of the largest |log-prob|
            assert_close_scaled(d["kl_orig_skill"], kl_os, scale=float(_kl_magnitude(lo, ls).max()), msg="KL(o‖s)")
            assert_close_scaled(d["kl_skill_orig"], kl_so, scale=float(_kl_magnitude(ls, lo).max()), msg="KL(s‖o)")
            vals, ids = ls.topk(5, -1)
            assert_close_scaled(d["topk_logp_skill"], vals, msg="top-k skill log-probs")
            assert_close_scaled(d["topk_logp_orig"], lo.gather(-1, d["topk_ids"].long()), msg="top-k orig log-probs")
            assert d["kl_orig_skill"].shape == (R,) and d["topk_ids"].shape == (R, 5)


def test_sampled_scorer_calls_the_model_as_before(setup):
    """algo.delta=sampled (divergence_topk None): the model function gets exactly the call it got before the
    switch existed (no pairs, no top-k), so the trainer's numbers are bit-identical to the paper path's."""
    from opid_mega.scoring.scorer import ForkScorer
    from opid_mega.trainer import divergence_topk

    pol, _ = setup
    calls = []

    def recording(mbs, **kw):
        calls.append(sorted(kw))
        return pol.packed_logprobs(mbs, **kw)

    assert divergence_topk(pol.cfg.algo) == 0  # the fixture's full_kl
    from dataclasses import replace
    assert divergence_topk(replace(pol.cfg.algo, delta="sampled")) is None
    assert divergence_topk(replace(pol.cfg.algo, delta="topk_kl")) == pol.cfg.algo.delta_topk
    res = score_requests(ForkScorer(recording, 4096, temperature=T), _requests())
    assert calls == [["temperature"]] and all(r.divergence == {} for r in res)
    score_requests(ForkScorer(recording, 4096, temperature=T, divergence_topk=3), _requests())
    assert calls[1] == ["pairs", "temperature", "topk"]


def test_full_kl_advantage_is_sampled_delta_plus_kl(setup):
    """OPID.md §7 with the switch: A = A_out + λ (Δ + KL(p_o‖p_s)) on routed tokens; here A_out = 0 (one group of
    equal rewards), so A / λ is the per-token term, checked against the float64 reference distributions."""
    from opid_mega.config import load_config
    from opid_mega.scoring.scorer import ForkScorer
    from opid_mega.experience import compute_advantages

    pol, hf = setup
    reqs = _requests()
    res = score_requests(ForkScorer(pol.packed_logprobs, 4096, temperature=T, divergence_topk=0), reqs)
    lam = 0.5
    cfg = load_config(CONFIG, ["scoring.scorer=fork", "algo.delta=full_kl", "algo.mode=no_routing",
                               "algo.skill_share_cap=null",  # one tied group: the uncapped term is the one checked
                               f"algo.lambda_episode={lam}", f"algo.lambda_step={lam}"])
    adv = compute_advantages(cfg.algo, res, [1.0] * 4, [False] * 4, [0] * 4)
    off = np.concatenate([[0], np.cumsum(adv.resp_lens)])
    for i, req in enumerate(reqs):
        R = len(req.response_ids)
        orig_ctx = _context(req, None)
        lo = _full(hf, orig_ctx, len(orig_ctx) - R)
        y = torch.tensor(req.response_ids)
        want = torch.zeros(R, dtype=torch.float64)
        size = torch.zeros(R, dtype=torch.float64)  # the magnitudes summed into `want` (they set its fp32 rounding)
        for kind in req.skills:
            ctx = _context(req, kind)
            ls = _full(hf, ctx, len(ctx) - R)
            ly, oy = ls.gather(-1, y[:, None])[:, 0], lo.gather(-1, y[:, None])[:, 0]
            want += lam * (ly - oy + (lo.exp() * (lo - ls)).sum(-1))
            size += lam * (ly.abs() + oy.abs() + _kl_magnitude(lo, ls))
        got = torch.from_numpy(adv.token_advantages[off[i]:off[i + 1]].astype(np.float64))
        assert_close_scaled(got, want, scale=float(size.max()) if req.skills else 1.0, msg=f"request {i}")


def test_distill_training_gradient_matches_float64_reference(setup):
    """One PPO micro-batch step with algo.distill_coef on fork-layout training batches: the gradient of
    coef · Σ KL(p_o‖p_s) / N (skill side stop-gradient) equals the float64 reference's (HF model, separate contexts),
    through megatron's schedule (what Policy.train runs)."""
    from opid_mega.megatron.logprobs import forward_step, run_schedule
    from opid_mega.megatron.policy import TrainData
    from opid_mega.megatron.train_step import LossConfig, ppo_loss_func
    from functools import partial

    pol, hf = setup
    reqs = _requests()
    seqs = [_context(r, None) for r in reqs]
    lens = [len(r.response_ids) for r in reqs]
    n = sum(lens)
    zeros = np.zeros(n, np.float32)
    coef = 0.3
    data = TrainData.from_sequences(seqs, lens, skills=[r.skills for r in reqs],
                                    old_logprobs=zeros, advantages=zeros)  # A = 0: the PPO term has zero gradient
    batches = data.micro_batches(4096)
    assert len(batches) == 1 and batches[0].pairs.shape == (2, sum(len(r.response_ids) * len(r.skills) for r in reqs))
    cfg = LossConfig(kl_coef=0.0, entropy_coef=0.0, temperature=T, distill_coef=coef)
    for c in pol.ddp:
        c.zero_grad_buffer()
    step = partial(forward_step, loss_func=partial(ppo_loss_func, cfg=cfg), temperature=T)
    outs = run_schedule(pol.ddp, batches, step, forward_only=False)  # what Policy.train runs
    # megatron's per-token loss: finalize_model_grads divides the summed loss's gradient by the n tokens
    got = {name: p.main_grad.detach().clone() for name, p in pol.ddp[0].module.named_parameters()}
    # reference: coef / n · Σ_pairs KL(p_o‖p_s), p_s detached, float64 HF model
    hf.zero_grad()
    total = torch.zeros((), dtype=torch.float64)
    kl_sum = torch.zeros((), dtype=torch.float64)
    for req in reqs:
        R = len(req.response_ids)
        oc = _context(req, None)
        lo = torch.log_softmax(hf(torch.tensor([oc])).logits[0, len(oc) - R - 1:len(oc) - 1].double() / T, -1)
        for kind in req.skills:
            sc = _context(req, kind)
            ls = _full(hf, sc, len(sc) - R)  # no grad: the teacher
            kl = (lo.exp() * (lo - ls)).sum(-1)
            kl_sum = kl_sum + kl.detach().sum()
            total = total + kl.sum()
    (coef * total / n).backward()
    ref = {n_: p.grad for n_, p in hf.named_parameters()}
    assert_close_scaled(float(outs[0]["distill_kl"][0]), float(kl_sum), rel=1e-4, floor=1.0, msg="Σ KL")
    assert float(outs[0]["distill_kl"][1]) == sum(len(r.response_ids) * len(r.skills) for r in reqs)
    for mine, theirs in (("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
                         ("decoder.final_layernorm.weight", "model.norm.weight")):
        g, r_ = got[mine].double(), ref[theirs]
        assert r_.abs().max() > 1e-6
        assert_close_scaled(g, r_, rel=1e-4, msg=mine)  # fp32 model + schedule vs float64 HF: 1e-4 of the largest
