"""Outcome (GRPO) advantage, the skill log-ratio Δ, and their combination (docs/algorithm.md §2, §6, §7)."""
from __future__ import annotations

from typing import Mapping, Optional

import torch

OUTCOME_MODES = ("mean_std_norm", "mean_norm")
# ε of the Δ normalisation (Δ − μ)/(σ + ε) (docs/algorithm.md "More reference facts"; the outcome advantage's
# 1e-6)
DELTA_NORM_EPS = 1e-6


def step_scores(episode_rewards: torch.Tensor, invalid: torch.Tensor, penalty: float) -> torch.Tensor:
    """S_i = R(trajectory of i) - penalty * 1[step i invalid], one value per step-sample (docs/algorithm.md §2).

    `episode_rewards` holds each step-sample's trajectory reward (broadcast over the trajectory's steps).
    """
    episode_rewards = torch.as_tensor(episode_rewards)
    invalid = torch.as_tensor(invalid)
    if episode_rewards.shape != invalid.shape:
        raise ValueError(f"step_scores: episode_rewards {tuple(episode_rewards.shape)} and invalid "
                         f"{tuple(invalid.shape)} must have the same shape")
    if penalty < 0:
        raise ValueError(f"step_scores: penalty={penalty} must be >= 0")
    return episode_rewards.to(torch.float32 if not episode_rewards.is_floating_point() else episode_rewards.dtype) \
        - penalty * invalid.to(torch.bool).to(episode_rewards.dtype if episode_rewards.is_floating_point()
                                                 else torch.float32)


def outcome_advantage(
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    mode: str = "mean_std_norm",
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO outcome advantage per step-sample (docs/algorithm.md §2).

    Group statistics are taken over ALL step-samples that share a group id (a task's G trajectories together),
    not one value per trajectory. `mean_norm`: A = S - μ; `mean_std_norm`: A = (S - μ) / (σ + eps), σ unbiased.
    A group with a single step-sample gets μ = 0, σ = 1 (as the reference code does).
    """
    if mode not in OUTCOME_MODES:
        raise ValueError(f"outcome_advantage: mode={mode!r}, allowed: {', '.join(OUTCOME_MODES)}")
    scores = torch.as_tensor(scores)
    group_ids = torch.as_tensor(group_ids)
    if scores.dim() != 1 or group_ids.shape != scores.shape:
        raise ValueError(f"outcome_advantage: scores {tuple(scores.shape)} and group_ids {tuple(group_ids.shape)} "
                         "must be 1-D and of equal length")
    if not scores.is_floating_point():
        scores = scores.to(torch.float32)
    if scores.numel() == 0:
        return scores.clone()
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    n_groups = counts.numel()
    sums = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, inverse, scores)
    counts_f = counts.to(scores.dtype)
    mean = sums / counts_f
    centered = scores - mean[inverse]
    sq = torch.zeros_like(sums).index_add_(0, inverse, centered * centered)
    std = torch.sqrt(sq / (counts_f - 1).clamp(min=1))
    single = counts == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    if mode == "mean_norm":
        return scores - mean[inverse]
    return (scores - mean[inverse]) / (std[inverse] + eps)


def skill_delta(
    skill_logp: torch.Tensor,
    orig_logp: torch.Tensor,
    mask: torch.Tensor,
    normalize: bool = False,
    clip: Optional[float] = None,
    eps: float = DELTA_NORM_EPS,
) -> torch.Tensor:
    """Δ_t = log π_old(y_t | h ⊕ s) - log π_old(y_t | h), zero where `mask` is 0 (docs/algorithm.md §6). No
    gradient.

    `normalize`: (Δ − μ)/(σ + eps) over the valid tokens, μ and σ (population) of those tokens, as the reference
    (docs/algorithm.md "More reference facts"). `clip`: then clamp to [-clip, clip]. Both off by default, as in the
    paper's runs.
    """
    if skill_logp.shape != orig_logp.shape or mask.shape != orig_logp.shape:
        raise ValueError(f"skill_delta: skill_logp {tuple(skill_logp.shape)}, orig_logp {tuple(orig_logp.shape)} and "
                         f"mask {tuple(mask.shape)} must have the same shape")
    if clip is not None and clip <= 0:
        raise ValueError(f"skill_delta: clip={clip} must be > 0 or None")
    if not eps > 0:
        raise ValueError(f"skill_delta: eps={eps} must be > 0")
    m = mask.to(torch.bool)
    delta = torch.where(m, (skill_logp - orig_logp).detach(), torch.zeros_like(orig_logp))
    if normalize and bool(m.any()):
        valid = delta[m]
        mean = valid.mean()
        std = valid.std(unbiased=False)
        delta = torch.where(m, (delta - mean) / (std + eps), torch.zeros_like(delta))
    if clip is not None:
        delta = delta.clamp(-clip, clip)
    return delta


def combine_advantages(
    outcome_adv: torch.Tensor,
    deltas_by_type: Mapping[str, torch.Tensor],
    lambdas_by_type: Mapping[str, float],
    token_mask: torch.Tensor,
) -> torch.Tensor:
    """A = A_out + Σ_k λ_k Δ_k per response token, zero outside `token_mask` (docs/algorithm.md §7).

    `outcome_adv` is per step-sample `[B]` (broadcast over tokens) or already per token (same shape as
    `token_mask`). Each Δ_k is zero on tokens its routing does not reach (see `skill_delta`), so under critical-first
    routing the masks are disjoint. Every type in `deltas_by_type` needs a λ.
    """
    mask = token_mask.to(torch.bool)
    adv = outcome_adv
    if adv.dim() == mask.dim() - 1 and adv.shape == mask.shape[:-1]:
        adv = adv.unsqueeze(-1)
    elif adv.shape != mask.shape:
        raise ValueError(f"combine_advantages: outcome_adv {tuple(outcome_adv.shape)} must be per sample "
                         f"{tuple(mask.shape[:-1])} or per token {tuple(mask.shape)}")
    total = adv.expand(mask.shape).to(torch.float32 if not adv.is_floating_point() else adv.dtype).clone()
    for kind, delta in deltas_by_type.items():
        if kind not in lambdas_by_type:
            raise ValueError(f"combine_advantages: no lambda for skill type {kind!r}")
        lam = float(lambdas_by_type[kind])
        if lam < 0:
            raise ValueError(f"combine_advantages: lambda for {kind!r} is {lam}, must be >= 0")
        if delta.shape != mask.shape:
            raise ValueError(f"combine_advantages: delta {kind!r} {tuple(delta.shape)} != mask {tuple(mask.shape)}")
        if lam != 0.0:
            total = total + lam * delta.to(total.dtype)
    return torch.where(mask, total, torch.zeros_like(total))
