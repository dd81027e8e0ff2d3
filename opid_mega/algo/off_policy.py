"""Off-policy correction for stale samples (train.max_staleness > 0; docs/algorithm.md "Bounded staleness").

A sample drawn by the behaviour policy π_b (the weights the rollout engines held) is trained on after the policy
moved on. The trainer rescores it under the current weights before the update (the proximal policy π_prox: PPO's
old log-probs, the skill contexts' log-probs and so Δ, all under the same θ), so the PPO ratio π_θ / π_prox and its
clip are those of an on-policy step. Decoupled PPO (Hilton et al. 2022; AReaL) adds the behaviour importance weight
w = π_prox / π_b per token, capped and without gradient, on the policy-gradient term. Clipped PPO's per-token loss
is positively homogeneous in the advantage (max(-A r, -A clip(r)) and the dual clip min(·, -A c) scale with any
w >= 0), so w · L(A) = L(w · A): the correction is the advantage times w, and every loss that takes the advantage
gets it.
"""
from __future__ import annotations

import numpy as np


def behavior_weights(prox_logprobs, behavior_logprobs, cap: float) -> np.ndarray:
    """Per token min(π_prox / π_b, cap) = min(exp(log π_prox − log π_b), cap) (float64). `cap` > 0 bounds the
    variance a token the behaviour policy found unlikely would add."""
    if not cap > 0:
        raise ValueError(f"behavior_weights: cap={cap!r} must be > 0")
    prox = np.asarray(prox_logprobs, np.float64)
    behav = np.asarray(behavior_logprobs, np.float64)
    if prox.shape != behav.shape:
        raise ValueError(f"behavior_weights: {prox.shape} proximal and {behav.shape} behaviour log-probs")
    return np.minimum(np.exp(np.minimum(prox - behav, np.log(cap))), cap)
