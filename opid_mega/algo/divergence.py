"""Divergence-based skill signal and the skill-context distillation loss (docs/algorithm.md "Beyond the sampled
token").

Inputs are the per-token outputs of `opid_mega.kernels.dual_context_divergence` (or any dict with the same keys):
p_s = π(· | h ⊕ s, y_<t) (skill context, teacher, stop-gradient), p_o = π(· | h, y_<t) (original context, the
policy that sampled y_t). No Megatron here.

    sampled  Δ_t = log p_s(y_t) − log p_o(y_t)                       (the paper; E_{y~p_o}[Δ_t] = −KL(p_o‖p_s))
    full_kl  Δ_t = log p_s(y_t) − log p_o(y_t) + KL(p_o‖p_s)_t       (Δ minus its exact conditional mean)
    topk_kl  Δ_t = log p_s(y_t) − log p_o(y_t) + KL_k(p_o‖p_s)_t     (the mean from the top-k of p_s plus one
                                                                      "rest" bucket: a lower bound of the KL)

All three keep "positive = reinforce" (the skill makes y_t more likely than p_o does, relative to the average token)
and give the same expected policy gradient, −λ ∇ KL(p_o‖p_s) per token: a term that does not depend on y_t (such as
−KL alone) has zero expected gradient when it multiplies ∇ log π(y_t), so the divergence enters the advantage only as
the exact baseline of Δ. The dense full-distribution gradient is the distillation loss: `distill_loss` =
coef · token-mean of KL(p_o‖p_s), back-propagated through the original context (all V entries at every token).
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch

from opid_mega.algo.loss import agg_loss

DELTA_KINDS = ("sampled", "full_kl", "topk_kl")
DISTILL_DIRECTIONS = ("reverse", "forward")
TOPK_DEFAULT = 32  # the default of algo.delta_topk: k of the top-k for algo.delta=topk_kl


def _need(out: Mapping[str, torch.Tensor], keys, what: str):
    missing = [k for k in keys if k not in out]
    if missing:
        raise ValueError(f"{what}: the divergence outputs lack {', '.join(missing)} (dual_context_divergence with "
                         f"{'topk > 0' if any(k.startswith('topk') for k in missing) else 'its defaults'})")


def topk_kl_orig_skill(out: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """KL(p_o‖p_s) of the two distributions coarsened to {the top-k ids of p_s, everything else}.

    With P_j = p_o(v_j), Q_j = p_s(v_j) over the k ids and the rest masses P_r = 1 − ΣP, Q_r = 1 − ΣQ:
    KL_k = Σ_j P_j (log P_j − log Q_j) + P_r (log P_r − log Q_r) — between 0 and the full KL (data processing
    inequality), equal to it when the top-k holds all of both distributions' mass."""
    _need(out, ("topk_logp_skill", "topk_logp_orig"), "topk_kl_orig_skill")
    lq = out["topk_logp_skill"].double()
    lp = out["topk_logp_orig"].double()
    p = lp.exp()
    head = (p * (lp - lq)).sum(-1)
    p_rest = (1.0 - p.sum(-1)).clamp_min(0.0)
    q_rest = (1.0 - lq.exp().sum(-1)).clamp_min(torch.finfo(torch.float64).tiny)
    tail = torch.special.xlogy(p_rest, p_rest) - torch.special.xlogy(p_rest, q_rest)
    return (head + tail).to(out["topk_logp_orig"].dtype)


def divergence_delta(out: Mapping[str, torch.Tensor], kind: str) -> torch.Tensor:
    """The per-token term added with λ in place of Δ (no gradient), for `algo.delta` = `kind`.

    `out`: per-token tensors `logp_skill`, `logp_orig`, and `kl_orig_skill` (full_kl) or `topk_logp_skill` /
    `topk_logp_orig` (topk_kl). Raw values: the trainer's masking by routing, `delta_normalize` and `delta_clip`
    apply to them exactly as to the sampled Δ."""
    if kind not in DELTA_KINDS:
        raise ValueError(f"divergence_delta: kind={kind!r}, allowed: {', '.join(DELTA_KINDS)}")
    _need(out, ("logp_skill", "logp_orig"), "divergence_delta")
    delta = (out["logp_skill"] - out["logp_orig"]).detach()
    return delta if kind == "sampled" else delta + delta_baseline(out, kind)


def delta_baseline(out: Mapping[str, torch.Tensor], kind: str) -> torch.Tensor:
    """What `kind` adds to the sampled Δ (no gradient): KL(p_o‖p_s) (full_kl), its top-k estimate (topk_kl), or 0
    (sampled, as a zero tensor shaped like `out["logp_orig"]`)."""
    if kind not in DELTA_KINDS:
        raise ValueError(f"divergence_delta: kind={kind!r}, allowed: {', '.join(DELTA_KINDS)}")
    if kind == "full_kl":
        _need(out, ("kl_orig_skill",), "divergence_delta")
        return out["kl_orig_skill"].detach()
    if kind == "topk_kl":
        return topk_kl_orig_skill({k: v.detach() for k, v in out.items()})
    _need(out, ("logp_orig",), "divergence_delta")
    return torch.zeros_like(out["logp_orig"]).detach()


def distill_loss(out: Mapping[str, torch.Tensor], mask: torch.Tensor, coef: float, direction: str = "reverse",
                 normalizer: Optional[float] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """coef · token-mean over `mask` of KL(p_o‖p_s) (`reverse`, default: the divergence Δ estimates, SDFT's
    on-policy objective) or KL(p_s‖p_o) (`forward`), differentiable through the original context only.

    `mask`: response tokens of step-samples whose routing gave a skill, bool, or float per-token weights (others
    contribute 0 but count in the normalizer when one is given, like the PPO loss: pass the mini-batch token count so micro-batches add up).
    Returns (loss, {"distill_kl": detached mean KL over the mask}). coef = 0 returns an exact 0 (no graph)."""
    if direction not in DISTILL_DIRECTIONS:
        raise ValueError(f"distill_loss: direction={direction!r}, allowed: {', '.join(DISTILL_DIRECTIONS)}")
    if not coef >= 0:
        raise ValueError(f"distill_loss: coef={coef} must be >= 0")
    key = "kl_orig_skill" if direction == "reverse" else "kl_skill_orig"
    _need(out, (key,), "distill_loss")
    kl = out[key]
    if kl.shape != mask.shape:
        raise ValueError(f"distill_loss: {key} {tuple(kl.shape)} and mask {tuple(mask.shape)} must have one shape")
    m = mask if mask.is_floating_point() else mask.to(torch.bool)  # float: per-token weights (the PPO loss's)
    metric = agg_loss(kl.detach(), m, "token-mean")
    if coef == 0:
        return torch.zeros((), dtype=kl.dtype, device=kl.device), {"distill_kl": metric}
    return coef * agg_loss(kl, m, "token-mean", normalizer=normalizer), {"distill_kl": metric}
