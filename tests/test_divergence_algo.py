"""algo.delta (sampled | full_kl | topk_kl) and the distillation loss (issue 15): the maths of README "Beyond the
sampled token" checked exactly by enumerating the vocabulary in float64, plus the config keys."""
import pytest
import torch

from opid_mega.algo import DELTA_KINDS, distill_loss, divergence_delta, topk_kl_orig_skill
from opid_mega.config import ConfigError, load_config
from tolerance import assert_close_scaled


def _dists(n=5, v=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = torch.randn(n, v, generator=g, dtype=torch.float64) * 2  # original-context logits (student)
    a = b + torch.randn(n, v, generator=g, dtype=torch.float64)  # skill-context logits (teacher)
    return a, b


def _outputs(a, b, k):
    """The kernel's per-token outputs for EVERY possible sampled token y: rows (i, y) flattened to [n * v]."""
    n, v = b.shape
    ls, lo = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    tk_lp, tk_id = ls.topk(k, -1)
    rep = lambda x: x.repeat_interleave(v, 0)  # noqa: E731
    return {"logp_skill": ls.reshape(-1), "logp_orig": lo.reshape(-1),
            "kl_skill_orig": rep((ls.exp() * (ls - lo)).sum(-1)), "kl_orig_skill": rep((lo.exp() * (lo - ls)).sum(-1)),
            "topk_logp_skill": rep(tk_lp), "topk_logp_orig": rep(lo.gather(-1, tk_id)),
            "topk_ids": rep(tk_id), "topk_mass": rep(tk_lp.exp().sum(-1))}


@pytest.mark.parametrize("kind", DELTA_KINDS)
def test_every_kind_has_the_expected_gradient_of_minus_reverse_kl(kind):
    """E_{y~p_o}[Δ(y) ∇_b log p_o(y)] = -∇_b KL(p_o || p_s) (p_s fixed): the policy gradient of the λ-term."""
    a, b = _dists()
    n, v = b.shape
    bb = b.clone().requires_grad_()
    lo = torch.log_softmax(bb, -1)
    delta = divergence_delta(_outputs(a, b, k=8), kind).reshape(n, v)
    # surrogate whose gradient is E_y[Δ(y) ∇ log p_o(y)] (weights p_o and Δ held fixed)
    (lo.exp().detach() * delta * lo).sum().backward()
    pg = bb.grad.clone()
    bb.grad = None
    kl = (torch.log_softmax(bb, -1).exp() * (torch.log_softmax(bb, -1) - torch.log_softmax(a, -1))).sum()
    kl.backward()
    torch.testing.assert_close(pg, -bb.grad, atol=1e-12, rtol=0)


def test_full_kl_has_zero_conditional_mean_and_sampled_has_minus_kl():
    a, b = _dists(seed=1)
    n, v = b.shape
    out = _outputs(a, b, k=8)
    p = torch.softmax(b, -1)
    mean_full = (p * divergence_delta(out, "full_kl").reshape(n, v)).sum(-1)
    mean_sampled = (p * divergence_delta(out, "sampled").reshape(n, v)).sum(-1)
    torch.testing.assert_close(mean_full, torch.zeros(n, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(mean_sampled, -out["kl_orig_skill"].reshape(n, v)[:, 0], atol=1e-12, rtol=0)
    # same conditional variance (a baseline shifts, it does not rescale)
    var = lambda d: (p * (d.reshape(n, v) - (p * d.reshape(n, v)).sum(-1, keepdim=True)) ** 2).sum(-1)  # noqa: E731
    torch.testing.assert_close(var(divergence_delta(out, "full_kl")), var(divergence_delta(out, "sampled")))
    # sampled is the paper's Δ exactly
    assert torch.equal(divergence_delta(out, "sampled"), out["logp_skill"] - out["logp_orig"])


def test_topk_kl_is_a_lower_bound_exact_with_the_whole_vocabulary():
    a, b = _dists(seed=2, v=30)
    full = _outputs(a, b, k=30)
    torch.testing.assert_close(topk_kl_orig_skill(full), full["kl_orig_skill"], atol=1e-12, rtol=0)
    prev = torch.zeros_like(full["kl_orig_skill"])
    for k in (1, 4, 12, 29):
        kl_k = topk_kl_orig_skill(_outputs(a, b, k=k))
        assert (kl_k >= -1e-12).all() and (kl_k <= full["kl_orig_skill"] + 1e-12).all()
        assert (kl_k >= prev - 1e-12).all()  # a finer partition never loses divergence
        prev = kl_k


def test_delta_with_kernel_outputs_matches_reference():
    from opid_mega.kernels import divergence_reference, dual_context_divergence
    g = torch.Generator().manual_seed(3)
    ho = torch.randn(12, 16, generator=g)
    hs = ho + 0.5 * torch.randn(12, 16, generator=g)
    w = torch.randn(300, 16, generator=g) / 4 * 3
    tg = torch.randint(0, 300, (12,), generator=g)
    out = dual_context_divergence(hs, ho, w, tg, topk=16, backend="torch", chunk_size=64)
    ref = divergence_reference(hs, ho, w, tg, topk=16)
    size = max(float(ref["logp_orig"].abs().max()), float(ref["logp_skill"].abs().max()))
    for kind in DELTA_KINDS:  # Δ is a difference of log-probs: fp32 vs float64 within 1e-5 of their size
        assert_close_scaled(divergence_delta(out, kind), divergence_delta(ref, kind), scale=size, msg=kind)
        assert not divergence_delta(out, kind).requires_grad


def test_distill_loss_masks_normalises_and_backpropagates():
    kl = torch.tensor([0.5, 1.0, 2.0, 4.0], requires_grad=True)
    fwd = torch.tensor([1.0, 1.0, 1.0, 1.0])
    mask = torch.tensor([True, False, True, False])
    loss, m = distill_loss({"kl_orig_skill": kl, "kl_skill_orig": fwd}, mask, coef=0.1)
    torch.testing.assert_close(loss, torch.tensor(0.1 * 2.5 / 2))
    torch.testing.assert_close(m["distill_kl"], torch.tensor(1.25))
    loss.backward()
    torch.testing.assert_close(kl.grad, torch.tensor([0.05, 0.0, 0.05, 0.0]))
    loss, _ = distill_loss({"kl_orig_skill": kl, "kl_skill_orig": fwd}, mask, coef=0.1, normalizer=10.0)
    torch.testing.assert_close(loss, torch.tensor(0.1 * 2.5 / 10))
    loss, _ = distill_loss({"kl_orig_skill": kl, "kl_skill_orig": fwd * 3}, mask, coef=1.0, direction="forward")
    torch.testing.assert_close(loss, torch.tensor(3.0))
    zero, _ = distill_loss({"kl_orig_skill": kl}, mask, coef=0.0)
    assert zero.item() == 0.0 and not zero.requires_grad
    with pytest.raises(ValueError, match="direction"):
        distill_loss({"kl_orig_skill": kl}, mask, coef=1.0, direction="both")
    with pytest.raises(ValueError, match="coef"):
        distill_loss({"kl_orig_skill": kl}, mask, coef=-1.0)
    with pytest.raises(ValueError, match="kl_skill_orig"):
        distill_loss({"kl_orig_skill": kl}, mask, coef=1.0, direction="forward")
    with pytest.raises(ValueError, match="one shape"):
        distill_loss({"kl_orig_skill": kl}, mask[:2], coef=1.0)


def test_divergence_delta_errors():
    out = {"logp_skill": torch.zeros(3), "logp_orig": torch.zeros(3)}
    with pytest.raises(ValueError, match="kind"):
        divergence_delta(out, "kl")
    with pytest.raises(ValueError, match="kl_orig_skill"):
        divergence_delta(out, "full_kl")
    with pytest.raises(ValueError, match="topk > 0"):
        divergence_delta(out, "topk_kl")


def test_config_keys():
    from opid_mega.algo.divergence import TOPK_DEFAULT

    cfg = load_config(None)
    assert cfg.algo.delta == "sampled" and cfg.algo.distill_coef == 0.0 and cfg.algo.delta_topk == TOPK_DEFAULT
    fork = "scoring.scorer=fork"
    ok = load_config(None, [fork, "algo.delta=topk_kl", "algo.delta_topk=8", "algo.distill_coef=0.05"])
    assert (ok.algo.delta, ok.algo.delta_topk, ok.algo.distill_coef) == ("topk_kl", 8, 0.05)
    assert load_config(None, ["algo.distill_coef=0.05"]).algo.distill_coef == 0.05  # any scorer: training computes it
    # a setting that would be silently ignored is refused with the reason
    with pytest.raises(ConfigError, match="algo.delta: got 'full_kl' with scoring.scorer=naive.*scoring.scorer=fork"):
        load_config(None, ["algo.delta=full_kl", "scoring.scorer=naive"])
    for mode in ("grpo", "skill_grpo"):
        with pytest.raises(ConfigError, match=f"algo.delta: got 'topk_kl' with algo.mode={mode}"):
            load_config(None, [fork, "algo.delta=topk_kl", f"algo.mode={mode}"])
        with pytest.raises(ConfigError, match=f"algo.distill_coef: got 0.01 with algo.mode={mode}"):
            load_config(None, ["algo.distill_coef=0.01", f"algo.mode={mode}"])
    for bad in ("algo.delta=full", "algo.distill_coef=-0.1", "algo.delta_topk=0", "algo.delta_topk=2.5",
                "algo.delta_topk=true"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            load_config(None, [fork, bad])
