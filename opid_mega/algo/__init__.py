"""The OPID algorithm as pure tensor functions: no Megatron, no trainer. Usable from any training script.

See docs/algorithm.md for the formulas; each function's docstring names the section it implements.
"""
from opid_mega.algo.advantage import (
    combine_advantages,
    outcome_advantage,
    skill_delta,
    step_scores,
)
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
    "combine_advantages",
    "delta_baseline",
    "distill_loss",
    "divergence_delta",
    "entropy_from_logits",
    "kl_penalty",
    "masked_mean",
    "outcome_advantage",
    "ppo_policy_loss",
    "reference_micro_weights",
    "route_skills",
    "skill_delta",
    "step_scores",
    "topk_kl_orig_skill",
]
