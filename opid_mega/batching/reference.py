"""Pure numpy reference of the batch builder: micro-batch packing (fork and plain layouts) and advantage assembly.

The C++ extension `opid_mega._C` implements the same four functions with byte-identical outputs; this module is
the specification and the fallback. It is the straightforward per-sample Python a Python engineer would write.

Packing (`plan_micro_batches`): every data-parallel rank gets the same number m of micro-batches; m starts at
max(min_micro_batches, ceil(total / (budget * ranks))) and grows by one until a greedy longest-first pass fits
every group under the budget. Longest-first: groups sorted by tokens descending (ties: lower group id first), each
into the least loaded of the ranks*m bins (ties: lower bin). Bin b is micro-batch b // ranks of rank b % ranks;
outputs are rank-major (flat micro-batch index k = rank * m + b // ranks). A group is never split.
"""
from __future__ import annotations

import heapq
import math
from typing import Optional, Sequence

import numpy as np

from opid_mega.batching.layout import (
    MAX_INT32,
    check_array,
    check_contexts,
    check_token_range,
    fill_micro_batch,
    group_samples,
    sample_prefix_lengths,
)

OUTCOME_MODES = ("mean_std_norm", "mean_norm")
DELTA_NORM_EPS = 1e-6  # ε of the Δ normalisation (Δ − μ)/(σ + ε) (docs/algorithm.md "More reference facts")
MAX_BINS = 1 << 20


def check_int(name: str, value, low: int, high: int = 2**62) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not low <= int(value) <= high:
        raise ValueError(f"{name}={int(value)} must be in [{low}, {high}]")
    return int(value)


def plan_micro_batches(group_tokens, budget: int, num_ranks: int = 1, min_micro_batches: int = 1):
    """Assign groups to micro-batches. Returns (micro_batch_of_group int64 [G] rank-major, micro_batches_per_rank)."""
    check_array("group_tokens", group_tokens, (np.int64,))
    budget = check_int("budget", budget, 1, MAX_INT32)
    num_ranks = check_int("num_ranks", num_ranks, 1, 1 << 20)
    min_micro_batches = check_int("min_micro_batches", min_micro_batches, 1, 1 << 20)
    if num_ranks * min_micro_batches > MAX_BINS:
        raise ValueError(f"num_ranks * min_micro_batches = {num_ranks * min_micro_batches} exceeds {MAX_BINS}")
    sizes = [int(x) for x in group_tokens]
    for g, size in enumerate(sizes):
        if size < 0:
            raise ValueError(f"group_tokens[{g}]={size} must be >= 0")
        if size > budget:
            raise ValueError(f"group {g} needs {size} tokens, more than the micro-batch budget {budget}")
    order = sorted(range(len(sizes)), key=lambda g: (-sizes[g], g))
    total = sum(sizes)
    m = max(min_micro_batches, -(-total // (budget * num_ranks)))
    while True:
        bins = num_ranks * m
        heap = [(0, b) for b in range(bins)]
        bin_of = [0] * len(sizes)
        ok = True
        for g in order:
            load, b = heapq.heappop(heap)
            if load + sizes[g] > budget:
                ok = False
                break
            bin_of[g] = b
            heapq.heappush(heap, (load + sizes[g], b))
        if ok:
            break
        m += 1
    mb = np.array([(b % num_ranks) * m + b // num_ranks for b in bin_of], dtype=np.int64)
    return mb, m


def build_batches(tokens, ctx_offsets, resp_lens, sample_offsets, budget: int, num_ranks: int = 1, *,
                  plain: bool = False, share_prompts: bool = True, max_group_tokens: Optional[int] = None,
                  min_micro_batches: int = 1, token_values=None) -> dict:
    """Fork (or plain) layout + packing of a whole batch into micro-batches; flat outputs (see batching/__init__)."""
    check_contexts(tokens, ctx_offsets, resp_lens, sample_offsets, plain=plain)
    budget = check_int("budget", budget, 1, MAX_INT32)
    num_ranks = check_int("num_ranks", num_ranks, 1, 1 << 20)
    max_group_tokens = budget if max_group_tokens is None else check_int("max_group_tokens", max_group_tokens,
                                                                         1, budget)
    value_offsets = None
    if token_values is not None:
        check_array("token_values", token_values, (np.float32,), int(resp_lens.sum()))
        value_offsets = np.zeros(resp_lens.size + 1, np.int64)
        np.cumsum(resp_lens, out=value_offsets[1:])
    prefix = sample_prefix_lengths(tokens, ctx_offsets, resp_lens, sample_offsets, plain=plain)
    groups = group_samples(tokens, ctx_offsets, sample_offsets, prefix, max_group_tokens,
                           share_prompts=share_prompts and not plain)
    mb_of_group, m = plan_micro_batches(groups.num_tokens, budget, num_ranks, min_micro_batches)
    num_mb = num_ranks * m
    mb_group_ids = np.argsort(mb_of_group, kind="stable").astype(np.int64)
    mb_group_offsets = np.zeros(num_mb + 1, np.int64)
    np.cumsum(np.bincount(mb_of_group, minlength=num_mb), out=mb_group_offsets[1:])

    keys = ["tokens", "position_ids", "gather_rows", "gather_targets", "cu_seqlens"]
    if plain:
        keys.append("loss_mask")  # and no branch_ids: the plain layout has no branches
    else:
        keys.append("branch_ids")
    if token_values is not None:
        keys.append("gather_values")
    parts = {k: [] for k in keys}
    mb_tok, mb_gather, mb_cu = [0], [0], [0]
    ctx_gather_start = np.zeros(resp_lens.size, np.int64)
    ctx_mb = np.zeros(resp_lens.size, np.int64)
    for k in range(num_mb):
        gids = mb_group_ids[mb_group_offsets[k]:mb_group_offsets[k + 1]]
        mb = fill_micro_batch(tokens, ctx_offsets, resp_lens, sample_offsets, groups, gids,
                              token_values=token_values, value_offsets=value_offsets, plain=plain)
        for key in keys:
            parts[key].append(mb[key])
        for c, start in mb["ctx_gather_start"].items():
            ctx_gather_start[c] = mb_gather[-1] + start
            ctx_mb[c] = k
        mb_tok.append(mb_tok[-1] + mb["tokens"].size)
        mb_gather.append(mb_gather[-1] + mb["gather_rows"].size)
        mb_cu.append(mb_cu[-1] + mb["cu_seqlens"].size)
    check_token_range(tokens)
    out = {key: np.concatenate(parts[key]) for key in keys}
    out.update(
        num_ranks=num_ranks,
        micro_batches_per_rank=m,
        mb_token_offsets=np.array(mb_tok, np.int64),
        mb_gather_offsets=np.array(mb_gather, np.int64),
        mb_cu_offsets=np.array(mb_cu, np.int64),
        mb_group_offsets=mb_group_offsets,
        mb_group_ids=mb_group_ids,
        group_sample_offsets=groups.sample_offsets,
        group_samples=groups.samples,
        group_prefix_lens=groups.prefix_lens,
        group_tokens=groups.num_tokens,
        group_micro_batch=mb_of_group,
        sample_prefix_lens=prefix,
        ctx_gather_start=ctx_gather_start,
        ctx_micro_batch=ctx_mb,
    )
    return out


# ----------------------------------------------------------------------------------------------- advantages
def outcome_advantage(scores, group_ids, mode: str = "mean_std_norm", eps: float = 1e-6) -> np.ndarray:
    """GRPO outcome advantage per step-sample over ragged groups (docs/algorithm.md §2), float64.

    Statistics over all samples sharing a group id: `mean_norm` S - μ, `mean_std_norm` (S - μ) / (σ + eps),
    σ unbiased; a single-sample group gets μ = 0, σ = 1. Sums are exact (math.fsum) so results are reproducible.
    """
    if mode not in OUTCOME_MODES:
        raise ValueError(f"mode={mode!r}, allowed: {', '.join(OUTCOME_MODES)}")
    check_array("scores", scores, (np.float32, np.float64))
    check_array("group_ids", group_ids, (np.int64,), scores.size)
    x = scores.astype(np.float64)
    if not np.all(np.isfinite(x)):
        raise ValueError(f"scores[{int(np.flatnonzero(~np.isfinite(x))[0])}] is not finite")
    members = {}
    for i, g in enumerate(group_ids.tolist()):
        members.setdefault(g, []).append(i)
    out = np.empty_like(x)
    for idx in members.values():
        vals = x[idx]
        n = len(idx)
        if n == 1:
            mu, sigma = 0.0, 1.0
        else:
            mu = math.fsum(vals.tolist()) / n
            sigma = math.sqrt(math.fsum(((vals - mu) ** 2).tolist()) / (n - 1))
        out[idx] = vals - mu if mode == "mean_norm" else (vals - mu) / (sigma + eps)
    return out


def token_advantages(outcome_adv, resp_lens, deltas: Sequence[np.ndarray], masks: Sequence[np.ndarray],
                     lambdas: Sequence[float], normalize: bool = False, clip: Optional[float] = None,
                     eps: float = DELTA_NORM_EPS, groups: Optional[np.ndarray] = None,
                     share_cap: Optional[float] = None) -> np.ndarray:
    """Per response token A = A_out + Σ_k λ_k Δ'_k (docs/algorithm.md §6-7), float32 flat over responses (sample
    order).

    `deltas[k]` float32/float64 [sum resp_lens]: raw Δ of skill type k (skill log-prob - original log-prob);
    `masks[k]` bool/uint8 [S]: samples routed to type k (Δ'_k = 0 elsewhere). `normalize`: (Δ_k − μ)/(σ + eps) over
    its valid tokens (μ, population σ from exact sums; the reference's form); `clip`: then clamp to ±clip. λ_k = 0 skips type k; λ_k < 0 is an error. Arithmetic in float64, rounded to float32 at the end.

    `share_cap` c (with `groups`, int64 [S]: the GRPO group of each sample; algo.skill_share_cap): the skill term
    K_t = Σ_k λ_k Δ'_k of each group g is scaled down so that Σ_{t∈g} |K_t| ≤ c · Σ_{t∈g} |A_out| (exact sums):
    A_t = A_out + f_g K_t with f_g = 1, or c·O_g / K_g when the group's skill mass K_g exceeds c·O_g. A group whose
    outcome advantages are all 0 (its scores tie) gets no skill term. None: no cap (the reference).
    """
    check_array("outcome_adv", outcome_adv, (np.float32, np.float64))
    check_array("resp_lens", resp_lens, (np.int64,), outcome_adv.size)
    if bool(np.any(resp_lens < 0)):
        raise ValueError(f"resp_lens[{int(np.flatnonzero(resp_lens < 0)[0])}] is negative")
    if not (len(deltas) == len(masks) == len(lambdas)):
        raise ValueError(f"deltas ({len(deltas)}), masks ({len(masks)}) and lambdas ({len(lambdas)}) must have "
                         "the same length")
    if clip is not None and not clip > 0:
        raise ValueError(f"clip={clip} must be > 0 or None")
    if not (eps > 0 and math.isfinite(eps)):
        raise ValueError(f"eps={eps} must be finite and > 0")
    if share_cap is not None:
        if not (float(share_cap) >= 0 and math.isfinite(float(share_cap))):
            raise ValueError(f"share_cap={share_cap} must be finite and >= 0, or None")
        if groups is None:
            raise ValueError("share_cap needs groups (the GRPO group of each sample)")
        check_array("groups", groups, (np.int64,), outcome_adv.size)
    total = int(resp_lens.sum())
    adv = np.repeat(outcome_adv.astype(np.float64), resp_lens)
    skill = np.zeros(total) if share_cap is not None else None  # the skill term alone, to cap it per group
    for k, (delta, mask, lam) in enumerate(zip(deltas, masks, lambdas)):
        check_array(f"deltas[{k}]", delta, (np.float32, np.float64), total)
        check_array(f"masks[{k}]", mask, (np.bool_, np.uint8), outcome_adv.size)
        lam = float(lam)
        if not lam >= 0 or math.isinf(lam):
            raise ValueError(f"lambdas[{k}]={lam} must be finite and >= 0")
        valid = np.repeat(mask.astype(bool), resp_lens)
        d = np.where(valid, delta.astype(np.float64), 0.0)
        if not np.all(np.isfinite(d)):
            raise ValueError(f"deltas[{k}][{int(np.flatnonzero(~np.isfinite(d))[0])}] is not finite")
        n = int(valid.sum())
        if normalize and n > 0:
            v = d[valid]
            mu = math.fsum(v.tolist()) / n
            std = math.sqrt(math.fsum(((v - mu) ** 2).tolist()) / n)
            d = np.where(valid, (d - mu) / (std + eps), 0.0)
        if clip is not None:
            d = np.minimum(np.maximum(d, -float(clip)), float(clip))
        if lam != 0.0:
            if skill is None:
                adv = adv + lam * d
            else:
                skill = skill + lam * d
    if skill is not None:
        adv = adv + skill * _group_share_scale(adv, skill, np.repeat(groups, resp_lens), float(share_cap))
    return adv.astype(np.float32)


def _group_share_scale(outcome: np.ndarray, skill: np.ndarray, token_groups: np.ndarray, cap: float) -> np.ndarray:
    """Per token f_g of token_advantages' share cap: 1 where the group's skill mass Σ|K| is at most cap x its outcome
    mass Σ|A_out| (exact sums), else cap·O_g / K_g."""
    scale = np.ones_like(skill)
    for g in np.unique(token_groups).tolist():
        at = token_groups == g
        o_mass = math.fsum(np.abs(outcome[at]).tolist())
        k_mass = math.fsum(np.abs(skill[at]).tolist())
        if k_mass > cap * o_mass:
            scale[at] = cap * o_mass / k_mass
    return scale
