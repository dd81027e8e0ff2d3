# custom_loss.py: a policy loss for opid-train (algo.loss_fn: "custom_loss:reinforce_loss")
from __future__ import annotations

from opid_mega.algo import agg_loss, masked_mean


def reinforce_loss(logp, old_logp, advantages, mask, normalizer=None, **unused):
    """Token-level REINFORCE: loss_t = -A_t · log π(y_t), no importance ratio and no clipping (the clip arguments
    in `unused` are ignored); its gradient -A_t ∇log π(y_t) is PPO's at ratio 1. Aggregated like the built-in:
    Σ mask·loss / normalizer (the Megatron loss passes the per-token weights as `mask` and normalizer=1)."""
    losses = -advantages * logp
    metrics = {"approx_kl": masked_mean(old_logp - logp, mask).detach()}
    return agg_loss(losses, mask, normalizer=normalizer), metrics
