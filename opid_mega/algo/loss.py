"""PPO dual-clip policy loss, KL estimators and entropy (docs/algorithm.md §8), with verl's semantics."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

LOSS_AGGS = ("token-mean", "token-mean-micro", "seq-mean-token-sum", "seq-mean-token-mean")
KL_KINDS = ("low_var_kl", "k1", "k2", "mse")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `x` over `mask` (0 when the mask is empty)."""
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1)


def _group_sums(values: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _, inv = torch.unique(ids, return_inverse=True)
    n = int(inv.max()) + 1 if inv.numel() else 0
    sums = torch.zeros(n, dtype=values.dtype, device=values.device).index_add_(0, inv, values * mask)
    cnt = torch.zeros(n, dtype=values.dtype, device=values.device).index_add_(0, inv, mask)
    return sums, cnt


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    agg: str = "token-mean",
    seq_ids: Optional[torch.Tensor] = None,
    normalizer: Optional[float] = None,
    micro_ids: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Aggregate per-token losses.

    `token-mean` (ours): Σ loss·mask / Σ mask over the whole input, i.e. one token mean over the whole mini-batch
    (or / `normalizer`, e.g. the mini-batch's token count, so that micro-batches add up to the mini-batch mean).
    `token-mean-micro` (the reference's): the token mean of each micro-batch, averaged over the micro-batches that
    hold a valid token — micro-batch k's tokens are those with `micro_ids == k` (one id per token; None: the whole
    input is one micro-batch); with the same number GA of micro-batches on each of DP data-parallel ranks this is
    (1/DP) Σ_ranks (1/GA) Σ_k mean_k, the reference's micro-batch loss divided by the gradient-accumulation count
    and averaged over the ranks (`normalizer`: divide the sum of the micro-batch means by it instead).
    `seq-mean-token-sum` / `seq-mean-token-mean`: per sequence sum / mean over its tokens, then the mean over
    sequences (or / `normalizer` sequences). Sequences are the rows of a 2-D input, or given by `seq_ids` (one id per
    token) for a flat packed input.
    """
    if agg not in LOSS_AGGS:
        raise ValueError(f"agg_loss: agg={agg!r}, allowed: {', '.join(LOSS_AGGS)}")
    m = mask.to(loss_mat.dtype)
    if agg == "token-mean":
        denom = m.sum().clamp(min=1) if normalizer is None else normalizer
        return (loss_mat * m).sum() / denom
    if agg == "token-mean-micro":
        if micro_ids is None:
            micro_ids = torch.zeros(loss_mat.shape, dtype=torch.long, device=loss_mat.device)
        if micro_ids.shape != loss_mat.shape:
            raise ValueError(f"agg_loss: micro_ids {tuple(micro_ids.shape)} must have the shape of the losses "
                             f"{tuple(loss_mat.shape)}")
        mb_sum, mb_cnt = _group_sums(loss_mat.reshape(-1), micro_ids.reshape(-1), m.reshape(-1))
        has = mb_cnt > 0
        denom = has.sum().clamp(min=1).to(loss_mat.dtype) if normalizer is None else normalizer
        return (mb_sum / mb_cnt.clamp(min=1) * has.to(loss_mat.dtype)).sum() / denom
    if loss_mat.dim() == 2 and seq_ids is None:
        seq_sum = (loss_mat * m).sum(-1)
        seq_cnt = m.sum(-1)
    else:
        if seq_ids is None:
            raise ValueError("agg_loss: a flat input needs seq_ids for sequence-level aggregation")
        seq_sum, seq_cnt = _group_sums(loss_mat, seq_ids, m)
    has = seq_cnt > 0
    per_seq = seq_sum if agg == "seq-mean-token-sum" else seq_sum / seq_cnt.clamp(min=1)
    denom = has.sum().clamp(min=1).to(loss_mat.dtype) if normalizer is None else normalizer
    return (per_seq * has.to(loss_mat.dtype)).sum() / denom


def reference_micro_weights(resp_lens, micro_batch_size: int):
    """Per response token weights (float32, flat in sample order) of the reference's loss aggregation over ONE
    mini-batch: its step-samples, in order, form micro-batches of ``micro_batch_size`` (the last may be shorter);
    every token of micro-batch k weighs 1 / (K x N_k), K micro-batches, N_k their response tokens. Σ w·l is then the
    mean over micro-batches of each one's token mean: the reference's per-GPU micro-batch token mean divided by the
    gradient-accumulation count and averaged over the data-parallel ranks, whenever each rank's share is a whole
    number of micro-batches (the paper's 256/32, 64/8, 512/16 on 8 GPUs)."""
    lens = np.asarray(resp_lens, np.int64)
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
    group = np.arange(lens.size) // int(micro_batch_size)
    per_group = np.bincount(group, weights=lens, minlength=int(group.max(initial=-1)) + 1)
    k = int(np.count_nonzero(per_group))
    w = np.where(per_group[group] > 0, 1.0 / (max(k, 1) * np.maximum(per_group[group], 1)), 0.0)
    return np.repeat(w, lens).astype(np.float32)


def ppo_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: Optional[float] = 3.0,
    agg: str = "token-mean",
    seq_ids: Optional[torch.Tensor] = None,
    normalizer: Optional[float] = None,
    micro_ids: Optional[torch.Tensor] = None,
    log_ratio_clamp: Optional[float] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with dual clip (docs/algorithm.md §8; verl's `compute_policy_loss`).

    ratio = exp(logp - old_logp), the log-ratio not clamped, as in the reference (`log_ratio_clamp` c: clamped to
    ±c first, as later verl versions do with c = 20); per token
    L = max(-A·ratio, -A·clip(ratio, 1-clip_low, 1+clip_high)), and for A < 0 additionally min(L, -A·dual_clip).
    Returns (loss, metrics) with metrics `clipfrac`, `clipfrac_dual` (fraction of tokens bounded by the dual clip)
    and `approx_kl` (mean of old_logp - logp), all detached.
    """
    if not (logp.shape == old_logp.shape == advantages.shape == mask.shape):
        raise ValueError(f"ppo_policy_loss: logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)}, advantages "
                         f"{tuple(advantages.shape)} and mask {tuple(mask.shape)} must have the same shape")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"ppo_policy_loss: dual_clip={dual_clip} must be > 1 or None")
    if log_ratio_clamp is not None and not log_ratio_clamp > 0:
        raise ValueError(f"ppo_policy_loss: log_ratio_clamp={log_ratio_clamp} must be > 0 or None")
    log_ratio = logp - old_logp
    if log_ratio_clamp is not None:
        log_ratio = torch.clamp(log_ratio, -log_ratio_clamp, log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped = torch.maximum(pg1, pg2)
    clipfrac = masked_mean(torch.gt(pg2, pg1).to(logp.dtype), mask)
    if dual_clip is not None:
        pg3 = -advantages * dual_clip
        dual = torch.minimum(pg3, clipped)
        clipfrac_dual = masked_mean((torch.gt(clipped, pg3) & (advantages < 0)).to(logp.dtype), mask)
        losses = torch.where(advantages < 0, dual, clipped)
    else:
        clipfrac_dual = torch.zeros((), dtype=logp.dtype, device=logp.device)
        losses = clipped
    loss = agg_loss(losses, mask, agg, seq_ids=seq_ids, normalizer=normalizer, micro_ids=micro_ids)
    metrics = {
        "clipfrac": clipfrac.detach(),
        "clipfrac_dual": clipfrac_dual.detach(),
        "approx_kl": masked_mean(-log_ratio, mask).detach(),
    }
    return loss, metrics


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference (verl's `kl_penalty`).

    `k1`: logp - ref; `k2` / `mse`: ½(logp - ref)² (verl treats the two names alike);
    `low_var_kl` (k3): exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10].
    """
    if kind == "k1":
        return logp - ref_logp
    if kind in ("k2", "mse"):
        return 0.5 * (logp - ref_logp).square()
    if kind == "low_var_kl":
        kl = torch.clamp(ref_logp - logp, -20.0, 20.0)
        return torch.clamp(torch.exp(kl) - kl - 1.0, -10.0, 10.0)
    raise ValueError(f"kl_penalty: kind={kind!r}, allowed: {', '.join(KL_KINDS)}")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dimension: logsumexp(z) - Σ softmax(z)·z."""
    logz = torch.logsumexp(logits, dim=-1)
    p = torch.softmax(logits, dim=-1)
    return logz - (p * logits).sum(-1)
