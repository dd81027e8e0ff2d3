"""The OPID algorithm as pure tensor functions: no Megatron, no trainer. Usable from any training script.

The advantage maths (outcome advantage, Δ normalisation and clip, A = A_out + Σ λ_k Δ_k) has one implementation, the
batch builder's: `opid_mega.batching.outcome_advantage` / `token_advantages` (C++, numpy reference beside it).

See docs/algorithm.md for the formulas; each function's docstring names the section it implements.
"""
from opid_mega.algo.divergence import DELTA_KINDS, delta_baseline, divergence_delta, distill_loss, topk_kl_orig_skill
from opid_mega.algo.loss import (agg_loss, entropy_from_logits, kl_penalty, masked_mean, ppo_policy_loss,
                                 reference_micro_weights)
from opid_mega.algo.off_policy import behavior_weights
from opid_mega.algo.routing import EPISODE, SKILL_KINDS, STEP, route_skills

__all__ = [
    "DELTA_KINDS",
    "EPISODE",
    "STEP",
    "SKILL_KINDS",
    "agg_loss",
    "behavior_weights",
    "delta_baseline",
    "distill_loss",
    "divergence_delta",
    "entropy_from_logits",
    "kl_penalty",
    "masked_mean",
    "ppo_policy_loss",
    "reference_micro_weights",
    "route_skills",
    "topk_kl_orig_skill",
]
