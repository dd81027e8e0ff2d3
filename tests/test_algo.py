"""opid_mega.algo against float64 references on random inputs, plus hand-worked OPID.md examples (the advantage
maths, in the batch builder: tests/test_advantage_maths.py)."""
import math

import pytest
import torch

from opid_mega.algo import agg_loss, entropy_from_logits, kl_penalty, ppo_policy_loss, route_skills


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


def ref_ppo(lp, olp, adv, mask, cl, ch, c, agg):
    """Plain-Python float64 reference (Python floats in and out: pytest.approx never sees a tensor)."""
    lp, olp, adv, m = lp.tolist(), olp.tolist(), adv.tolist(), mask.tolist()
    rows, cols = len(lp), len(lp[0])
    losses, clipped, dual = [], [], []
    for i in range(rows):
        row = []
        for j in range(cols):
            r = math.exp(lp[i][j] - olp[i][j])  # the reference does not clamp the log-ratio
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


def test_loss_aggregations_worked_by_hand():
    """OPID.md "More reference facts", loss aggregation, on a hand-worked split. One rank, two micro-batches with 3
    and 1 valid tokens (per-token losses 1, 2, 6 | 4; a masked-out 100 in the second):
      token-mean-micro (the reference's): [(1 + 2 + 6)/3 + 4/1] / 2 = (3 + 4)/2 = 3.5;
      token-mean (ours): (1 + 2 + 6 + 4)/4 = 3.25.
    Two data-parallel ranks, rank 0 as above and rank 1 with micro-batches 2, 8 | 5 (GA = 2 on each):
      reference: 1/2 [ (3 + 4)/2 + (5 + 5)/2 ] = 4.25;  ours: (13 + 15)/7 = 4.0."""
    loss = torch.tensor([1.0, 2.0, 6.0, 4.0, 100.0], dtype=torch.float64)
    mask = torch.tensor([1, 1, 1, 1, 0])
    micro = torch.tensor([0, 0, 0, 1, 1])
    assert agg_loss(loss, mask, "token-mean-micro", micro_ids=micro).item() == 3.5
    assert agg_loss(loss, mask, "token-mean").item() == 3.25
    loss2 = torch.cat([loss, torch.tensor([2.0, 8.0, 5.0], dtype=torch.float64)])
    mask2 = torch.cat([mask, torch.ones(3, dtype=torch.long)])
    micro2 = torch.cat([micro, torch.tensor([2, 2, 3])])  # rank 1's micro-batches: ids 2 and 3
    assert agg_loss(loss2, mask2, "token-mean-micro", micro_ids=micro2).item() == 4.25
    assert agg_loss(loss2, mask2, "token-mean").item() == 4.0
    # a micro-batch with no valid token is not counted; no micro_ids: the input is one micro-batch
    assert agg_loss(loss, mask, "token-mean-micro", micro_ids=torch.tensor([0, 0, 0, 1, 2])).item() == 3.5
    assert agg_loss(loss, mask, "token-mean-micro").item() == 3.25
    with pytest.raises(ValueError, match="micro_ids"):
        agg_loss(loss, mask, "token-mean-micro", micro_ids=torch.zeros(3, dtype=torch.long))
    # through the PPO loss: ratio 1 (logp = old), so the per-token loss is -A
    adv = -loss
    got, _ = ppo_policy_loss(torch.zeros(5), torch.zeros(5), adv, mask.double(), agg="token-mean-micro",
                             micro_ids=micro)
    assert got.item() == 3.5


def test_reference_micro_batch_weights_worked_by_hand():
    """train.micro_batch_size (token-mean-micro): the mini-batch's step-samples in order, 2 per micro-batch.
    Response lengths 3, 1 | 2: K = 2 micro-batches of 4 and 2 tokens, weights 1/(2*4) and 1/(2*2); with per-token
    losses 1, 2, 6, 4 | 5, 5 the weighted sum is 13/8 + 10/4 = 4.125 = [(13/4) + (10/2)] / 2."""
    import numpy as np

    from opid_mega.algo import reference_micro_weights

    w = reference_micro_weights(np.array([3, 1, 2]), 2)
    assert w.tolist() == [0.125] * 4 + [0.25] * 2
    assert float(np.dot(w, [1, 2, 6, 4, 5, 5])) == 4.125
    # a step-sample without response tokens weighs nothing and a micro-batch without tokens is not counted
    assert reference_micro_weights(np.array([0, 0, 2, 2]), 2).tolist() == [0.25] * 4
    with pytest.raises(ValueError, match="micro_batch_size"):
        reference_micro_weights(np.array([1]), 0)


def test_log_ratio_not_clamped_by_default():
    """The reference does not clamp the PPO log-ratio (OPID.md "More reference facts"): at log-ratio 25 with A = -1
    and no dual clip the loss is e^25 (with the optional ±20 clamp, e^20)."""
    logp, old, adv, mask = torch.tensor([25.0], dtype=torch.float64), torch.zeros(1, dtype=torch.float64), \
        -torch.ones(1, dtype=torch.float64), torch.ones(1)
    loss, m = ppo_policy_loss(logp, old, adv, mask, dual_clip=None)
    assert loss.item() == pytest.approx(math.exp(25), rel=1e-12) and m["approx_kl"].item() == -25.0
    loss, _ = ppo_policy_loss(logp, old, adv, mask, dual_clip=None, log_ratio_clamp=20.0)
    assert loss.item() == pytest.approx(math.exp(20), rel=1e-12)
    with pytest.raises(ValueError, match="log_ratio_clamp"):
        ppo_policy_loss(logp, old, adv, mask, log_ratio_clamp=0.0)


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
