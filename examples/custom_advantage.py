# custom_advantage.py: an advantage function for opid-train (algo.advantage_fn: "custom_advantage:rloo_advantages")
from __future__ import annotations

import numpy as np

from opid_mega.experience import Experience, with_skill_term


def rloo_advantages(exp: Experience, algo_cfg) -> None:
    """RLOO's outcome advantage with OPID's skill term: A_out of step-sample i is r_i minus the mean r of the OTHER
    step-samples of its group (0 in a group of one), r = score - algo.invalid_penalty * invalid, not divided by a
    standard deviation; the token advantages add λ_k Δ_k exactly as the built-in does (with_skill_term)."""
    r = exp.scores - algo_cfg.invalid_penalty * exp.invalid
    a_out = np.zeros(exp.num_samples)  # float64
    for g in np.unique(exp.groups):
        members = exp.groups == g
        n = int(members.sum())
        if n > 1:
            a_out[members] = r[members] - (r[members].sum() - r[members]) / (n - 1)
    exp.a_out = a_out
    exp.token_advantages = with_skill_term(exp, algo_cfg, a_out)  # float32, one per response token
