"""opid_mega.algo against float64 references on random inputs, plus hand-worked OPID.md examples."""
import math
import random

import pytest
import torch

from opid_mega.algo import (
    combine_advantages,
    entropy_from_logits,
    kl_penalty,
    outcome_advantage,
    ppo_policy_loss,
    route_skills,
    skill_delta,
    step_scores,
)


def ref_outcome(scores, groups, mode, eps=1e-6):
    out = []
    for s, g in zip(scores, groups):
        members = [x for x, h in zip(scores, groups) if h == g]
        if len(members) == 1:
            mu, sd = 0.0, 1.0
        else:
            mu = sum(members) / len(members)
            sd = math.sqrt(sum((x - mu) ** 2 for x in members) / (len(members) - 1))
        out.append(s - mu if mode == "mean_norm" else (s - mu) / (sd + eps))
    return out


@pytest.mark.parametrize("mode", ["mean_std_norm", "mean_norm"])
@pytest.mark.parametrize("seed", range(5))
def test_outcome_advantage_matches_float64_reference(mode, seed):
    rng = random.Random(seed)
    n = rng.randint(1, 60)
    groups = [rng.randint(0, 6) for _ in range(n)]
    scores = [rng.choice([0.0, 10.0]) - rng.choice([0.0, 0.1]) + rng.gauss(0, 0.3) for _ in range(n)]
    got = outcome_advantage(torch.tensor(scores, dtype=torch.float64), torch.tensor(groups), mode)
    want = torch.tensor(ref_outcome(scores, groups, mode), dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_outcome_advantage_hand_worked():
    # One task group: trajectory A won (R=10) with 2 steps, the second invalid; trajectory B failed (R=0), 2 steps.
    s = step_scores(torch.tensor([10.0, 10.0, 0.0, 0.0]), torch.tensor([False, True, False, False]), 0.1)
    assert s.tolist() == pytest.approx([10.0, 9.9, 0.0, 0.0])
    a = outcome_advantage(s, torch.tensor([7, 7, 7, 7]), "mean_norm")
    assert a.tolist() == pytest.approx([10 - 4.975, 9.9 - 4.975, -4.975, -4.975])
    sd = math.sqrt(sum((x - 4.975) ** 2 for x in [10, 9.9, 0, 0]) / 3)
    a = outcome_advantage(s.double(), torch.tensor([7, 7, 7, 7]), "mean_std_norm")
    assert a[0].item() == pytest.approx((10 - 4.975) / (sd + 1e-6))
    # A single step-sample group: mu = 0, sigma = 1.
    assert outcome_advantage(torch.tensor([3.0]), torch.tensor([1]), "mean_std_norm").item() == pytest.approx(
        3.0 / (1 + 1e-6))


def test_outcome_advantage_errors():
    with pytest.raises(ValueError, match="mode"):
        outcome_advantage(torch.ones(2), torch.zeros(2), "bogus")
    with pytest.raises(ValueError, match="equal length"):
        outcome_advantage(torch.ones(2), torch.zeros(3))
    with pytest.raises(ValueError, match="penalty"):
        step_scores(torch.ones(2), torch.zeros(2), -1)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("normalize,clip", [(False, None), (True, None), (False, 0.05), (True, 1.5)])
def test_skill_delta_matches_reference(seed, normalize, clip):
    g = torch.Generator().manual_seed(seed)
    skill = torch.randn(5, 9, generator=g, dtype=torch.float64) - 2
    orig = torch.randn(5, 9, generator=g, dtype=torch.float64) - 2
    mask = torch.rand(5, 9, generator=g) > 0.3
    got = skill_delta(skill, orig, mask, normalize=normalize, clip=clip)
    vals = [(skill[i, j] - orig[i, j]).item() for i in range(5) for j in range(9) if mask[i, j]]
    mu = sum(vals) / len(vals)
    sd = math.sqrt(sum((v - mu) ** 2 for v in vals) / len(vals))
    for i in range(5):
        for j in range(9):
            if not mask[i, j]:
                assert got[i, j].item() == 0.0
                continue
            d = (skill[i, j] - orig[i, j]).item()
            if normalize:
                d = (d - mu) / sd
            if clip is not None:
                d = max(-clip, min(clip, d))
            assert got[i, j].item() == pytest.approx(d, rel=1e-12, abs=1e-12)


def test_skill_delta_constant_normalizes_mean_only_and_stops_gradient():
    skill = torch.full((3, 4), -1.0, requires_grad=True)
    orig = torch.full((3, 4), -1.5)
    mask = torch.ones(3, 4)
    d = skill_delta(skill, orig, mask, normalize=True)
    assert torch.all(d == 0) and not d.requires_grad
    with pytest.raises(ValueError, match="same shape"):
        skill_delta(skill, orig[:, :2], mask)


def test_route_skills_table():
    steps, ep = {1: "s1", 3: "s3"}, "E"
    assert route_skills(4, steps, ep) == [{"episode": "E"}, {"step": "s1"}, {"episode": "E"}, {"step": "s3"}]
    assert route_skills(4, steps, ep, mode="additive") == [
        {"episode": "E"}, {"episode": "E", "step": "s1"}, {"episode": "E"}, {"episode": "E", "step": "s3"}]
    assert route_skills(4, steps, ep, use_episode=False) == [{}, {"step": "s1"}, {}, {"step": "s3"}]
    assert route_skills(4, steps, ep, use_step=False) == [{"episode": "E"}] * 4
    assert route_skills(4, steps, ep, mode="additive", use_step=False) == [{"episode": "E"}] * 4
    assert route_skills(3, None, None) == [{}, {}, {}]  # failed analysis: no skill anywhere
    with pytest.raises(ValueError, match="outside"):
        route_skills(2, {5: "x"}, ep)
    with pytest.raises(ValueError, match="mode"):
        route_skills(2, {}, ep, mode="x")


@pytest.mark.parametrize("seed", range(3))
def test_combine_advantages_reference(seed):
    g = torch.Generator().manual_seed(seed)
    b, t = 6, 7
    a_out = torch.randn(b, generator=g, dtype=torch.float64)
    mask = torch.rand(b, t, generator=g) > 0.2
    d_ep = torch.randn(b, t, generator=g, dtype=torch.float64) * (torch.rand(b, t, generator=g) > 0.5)
    d_st = torch.randn(b, t, generator=g, dtype=torch.float64) * (d_ep == 0)
    lam = {"episode": 0.37, "step": 1.3}
    got = combine_advantages(a_out, {"episode": d_ep, "step": d_st}, lam, mask)
    for i in range(b):
        for j in range(t):
            want = (a_out[i] + 0.37 * d_ep[i, j] + 1.3 * d_st[i, j]).item() if mask[i, j] else 0.0
            assert got[i, j].item() == pytest.approx(want, rel=1e-12, abs=1e-12)
    # lambda = 0 (GRPO) leaves exactly the outcome advantage
    grpo = combine_advantages(a_out, {"episode": d_ep, "step": d_st}, {"episode": 0.0, "step": 0.0}, mask)
    assert torch.equal(grpo, torch.where(mask, a_out[:, None].expand(b, t), torch.zeros(b, t, dtype=torch.float64)))
    with pytest.raises(ValueError, match="no lambda"):
        combine_advantages(a_out, {"episode": d_ep}, {}, mask)
    with pytest.raises(ValueError, match=">= 0"):
        combine_advantages(a_out, {"episode": d_ep}, {"episode": -1.0}, mask)


def ref_ppo(lp, olp, adv, mask, cl, ch, c, agg):
    """Plain-Python float64 reference (Python floats in and out: pytest.approx never sees a tensor)."""
    lp, olp, adv, m = lp.tolist(), olp.tolist(), adv.tolist(), mask.tolist()
    rows, cols = len(lp), len(lp[0])
    losses, clipped, dual = [], [], []
    for i in range(rows):
        row = []
        for j in range(cols):
            r = math.exp(max(-20, min(20, lp[i][j] - olp[i][j])))
            a = adv[i][j]
            l1, l2 = -a * r, -a * min(max(r, 1 - cl), 1 + ch)
            l = max(l1, l2)
            if m[i][j]:
                clipped.append(1.0 if l2 > l1 else 0.0)
                dual.append(1.0 if (a < 0 and l > -a * c) else 0.0)
            if a < 0:
                l = min(l, -a * c)
            row.append(l)
        losses.append(row)
    if agg == "token-mean":
        tot = sum(losses[i][j] for i in range(rows) for j in range(cols) if m[i][j])
        loss = tot / max(1, int(sum(map(sum, m))))
    else:
        per = []
        for i in range(rows):
            vals = [losses[i][j] for j in range(cols) if m[i][j]]
            if vals:
                per.append(sum(vals) if agg == "seq-mean-token-sum" else sum(vals) / len(vals))
        loss = sum(per) / max(1, len(per))
    return loss, sum(clipped) / len(clipped), sum(dual) / len(dual)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("seed", range(3))
def test_ppo_policy_loss_matches_reference(agg, seed):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(4, 8, generator=g, dtype=torch.float64) - 1
    logp = (old + 0.4 * torch.randn(4, 8, generator=g, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(4, 8, generator=g, dtype=torch.float64) * 2
    mask = (torch.rand(4, 8, generator=g) > 0.25).double()
    loss, m = ppo_policy_loss(logp, old, adv, mask, 0.2, 0.28, 3.0, agg)
    want, cf, cfd = ref_ppo(logp.detach(), old, adv, mask, 0.2, 0.28, 3.0, agg)
    assert isinstance(want, float)
    assert loss.item() == pytest.approx(want, rel=1e-12)
    assert m["clipfrac"].item() == pytest.approx(cf)
    assert m["clipfrac_dual"].item() == pytest.approx(cfd)
    assert m["approx_kl"].item() == pytest.approx(((old - logp.detach()) * mask).sum().item() / mask.sum().item())
    # Gradient = finite differences of the same function in float64.
    assert torch.autograd.gradcheck(lambda x: ppo_policy_loss(x, old, adv, mask, 0.2, 0.28, 3.0, agg)[0], (logp,))
    # The same loss from flat, packed inputs with seq_ids.
    seq = torch.arange(4).repeat_interleave(8)
    flat, _ = ppo_policy_loss(logp.reshape(-1), old.reshape(-1), adv.reshape(-1), mask.reshape(-1), 0.2, 0.28, 3.0,
                              agg, seq_ids=seq)
    assert flat.item() == pytest.approx(want, rel=1e-12)


def test_ppo_loss_is_zero_ratio_one_at_step_zero():
    old = torch.randn(3, 5, dtype=torch.float64)
    adv = torch.randn(3, 5, dtype=torch.float64)
    loss, m = ppo_policy_loss(old.clone(), old, adv, torch.ones(3, 5))
    assert m["approx_kl"].item() == 0.0 and m["clipfrac"].item() == 0.0
    assert loss.item() == pytest.approx(-adv.mean().item())


@pytest.mark.parametrize("kind", ["low_var_kl", "k1", "k2", "mse"])
def test_kl_penalty(kind):
    g = torch.Generator().manual_seed(1)
    lp = torch.randn(50, generator=g, dtype=torch.float64) * 3
    ref = torch.randn(50, generator=g, dtype=torch.float64) * 3
    got = kl_penalty(lp, ref, kind)
    for x, r, v in zip(lp.tolist(), ref.tolist(), got.tolist()):
        if kind == "k1":
            want = x - r
        elif kind in ("k2", "mse"):
            want = 0.5 * (x - r) ** 2
        else:
            k = max(-20, min(20, r - x))
            want = max(-10, min(10, math.exp(k) - k - 1))
        assert v == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert torch.all(kl_penalty(lp, lp, kind) == 0)
    with pytest.raises(ValueError, match="kind"):
        kl_penalty(lp, ref, "k9")


def test_entropy_from_logits():
    g = torch.Generator().manual_seed(3)
    z = torch.randn(7, 33, generator=g, dtype=torch.float64) * 4
    got = entropy_from_logits(z)
    for i in range(7):
        row = z[i].tolist()
        mx = max(row)
        ex = [math.exp(v - mx) for v in row]
        s = sum(ex)
        want = -sum((e / s) * math.log(e / s) for e in ex)
        assert got[i].item() == pytest.approx(want, rel=1e-10)
