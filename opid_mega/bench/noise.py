"""opid-bench delta_noise: the noise floor of the skill signal Δ = log π(y | h ⊕ s) − log π(y | h) on a
megatron-core model, per scoring dtype (float32, bfloat16, float16), against the |λΔ| of a real run.

Δ is a difference of two log-probs of the same tokens, so any rounding that differs between the two contexts'
forwards lands in it. The op scores the same step-samples (random prompts, a skill section inserted late, R response
tokens: `rescoring`'s shapes and model, random weights, `NOISE` step-samples) in several arrangements that are
equal in exact arithmetic, one row each (timed: the cost of scoring in that dtype):
  fork, one micro-batch            the fork scorer, every step-sample in one packed micro-batch (the
                                   reference arrangement of the rows below)
  fork, one step-sample per batch  the same, each step-sample its own micro-batch (batch composition and shapes)
  fork, reversed order             the step-samples packed in reverse order (every row at another offset)
  two-pass naive scorer            each context its own sequence (fork layout vs two passes)
  fork, empty skill                an empty skill section: both contexts are the same tokens, Δ is exactly 0
  two-pass, empty skill            the same in the two-pass layout
Errors (per token, over all response tokens): `noise_p50` / `noise_p90` / `noise_p99` / `noise_max` of
|Δ − Δ of the one-micro-batch row| (the empty-skill rows: of |Δ|), and `float64_max`: the largest |Δ − Δ in float64|
(the same weights, every operation in float64, each context its own sequence). Each case also gives the float64 Δ's own
quantiles (`delta_float64`): the size of this random model's signal.
With `--advantages FILE` (a run's `logging.dump_advantages=true` file; λ per skill kind from the run's config.yaml
beside it, else `--lam`) every case carries `signal`: the quantiles of that run's |λΔ| over its skill tokens, and
per noise row the share of those tokens whose |λΔ| is below λ x the row's noise p99 and the share of the total |λΔ| they
carry (`buried_tokens`, `buried_mass`): how much of the real signal that noise would drown.
"""
from __future__ import annotations

import json
import os

import numpy as np
import torch

from .core import Case, Method, Preset

DTYPES = ("float32", "bfloat16", "float16")
NOISE = {"tiny": 16, "ci": 8, "7b": 16, "32b": 16}  # step-samples per case
QUANTILES = (0.5, 0.9, 0.99)
PLACEMENT = "late"


def quantiles(x: np.ndarray, prefix: str) -> dict:
    """{prefix_p50, prefix_p90, prefix_p99, prefix_max} of |x|."""
    a = np.abs(np.asarray(x, dtype=np.float64))
    out = {f"{prefix}_p{round(q * 100)}": float(np.quantile(a, q)) for q in QUANTILES}
    out[f"{prefix}_max"] = float(a.max())
    return out


def _run_config(path: str) -> dict:
    """The run's config.yaml beside its advantages file ({} when there is none)."""
    cfg = os.path.join(os.path.dirname(os.path.abspath(path)), "config.yaml")
    if not os.path.exists(cfg):
        return {}
    import yaml

    with open(cfg) as f:
        return yaml.safe_load(f) or {}


def signal(path: str, lam=None) -> dict:
    """|λΔ| of a run's dumped advantages (one JSON record per step-sample with `delta`: {kind: [Δ per token]}): its
    quantiles over every skill token, λ per kind (`lam`, else algo.lambda_episode / lambda_step of the run's
    config.yaml), the run's env and model, and the values (sorted, for `buried`)."""
    cfg = _run_config(path)
    if lam is not None:
        lams = {"episode": float(lam), "step": float(lam)}
    elif cfg.get("algo"):
        lams = {"episode": float(cfg["algo"]["lambda_episode"]), "step": float(cfg["algo"]["lambda_step"])}
    else:
        raise ValueError(f"delta_noise: no config.yaml beside {path} to read λ from; give --lam")
    vals, iterations, samples = [], set(), 0
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            samples += 1
            iterations.add(rec.get("iteration"))
            for kind, d in (rec.get("delta") or {}).items():
                vals.append(np.abs(np.asarray(d, dtype=np.float64)) * lams[kind])
    if not vals:
        raise ValueError(f"delta_noise: {path} holds no skill Δ (no `delta` in its records)")
    v = np.sort(np.concatenate(vals))
    model = cfg.get("model", {})
    return {"env": cfg.get("env", {}).get("name"), "model": model.get("builtin") or model.get("path"),
            "model_dtype": model.get("dtype"), "lambda": lams, "iterations": len(iterations),
            "step_samples": samples, "tokens": int(v.size), **quantiles(v, "lambda_delta"), "_sorted": v}


def buried(sig: dict, lam: float, noise_p99: float) -> dict:
    """Share of the run's skill tokens whose |λΔ| is at most λ x noise_p99, and the share of the total |λΔ| they
    carry."""
    v = sig["_sorted"]
    k = int(np.searchsorted(v, lam * noise_p99, side="right"))
    return {"buried_tokens": k / v.size, "buried_mass": float(v[:k].sum() / v.sum()) if v.sum() > 0 else 0.0}


def _fmt_q(q: dict) -> str:
    """'p50 … p90 … p99 … max …' of a dict holding `quantiles`' keys (among others)."""
    return " ".join(f"{k.rsplit('_', 1)[-1]} {v:.2e}" for k, v in q.items()
                    if k.rsplit("_", 1)[-1] in ("p50", "p90", "p99", "max"))


def _deltas(results, kind: str = "episode") -> np.ndarray:
    return torch.cat([r.skill[kind].double() - r.orig.double() for r in results]).numpy()


def _arrangements(chunks, reqs: list, empty: list, one: int) -> list:
    """[(row, role, call, what its Δ is compared with: "none" (the reference row itself), "ref" (the one-micro-batch
    Δ), "zero" (an empty skill))] over the model chunks of one dtype."""
    from .scoring import scorers

    naive, fork = scorers(chunks, one * len(reqs) + 1)
    _, fork_each = scorers(chunks, one)
    return [("fork, one micro-batch", "ours", lambda: _score(fork, reqs), "none"),
            ("fork, one step-sample per micro-batch", "ours", lambda: _score(fork_each, reqs), "ref"),
            ("fork, reversed order", "ours", lambda: _score(fork, reqs[::-1])[::-1], "ref"),
            ("two-pass naive scorer", "peer", lambda: _score(naive, reqs), "ref"),
            ("fork, empty skill", "ours", lambda: _score(fork, empty), "zero"),
            ("two-pass, empty skill", "peer", lambda: _score(naive, empty), "zero")]


def _score(scorer, requests: list) -> list:
    """One ScoreResult per request."""
    from opid_mega.scoring.scorer import score_requests

    return score_requests(scorer, requests)


def delta_noise_cases(preset: Preset, device: torch.device, compile_peers: bool = True, advantages: str = None,
                      lam=None) -> list:
    from opid_mega.megatron import weights
    from opid_mega.scoring.scorer import ScoreRequest

    from .scoring import _megatron_model, _requests, arch, model_dims, random_weights, reference_logprobs, \
        rescoring_shape

    dims = model_dims(preset)
    a = arch(dims)
    w = random_weights(a, device)
    shape = rescoring_shape(preset, PLACEMENT)
    reqs = _requests(shape, NOISE[preset.name], dims["vocab"], seed=1)
    empty = [ScoreRequest(r.prompt_ids, r.response_ids, {"episode": (r.skills["episode"][0], [])}) for r in reqs]
    d64, scale = [], 0.0
    for r in reqs:
        at, section = r.skills["episode"]
        prompt, resp = list(r.prompt_ids), list(r.response_ids)
        skill = reference_logprobs(w, a, prompt[:at] + list(section) + prompt[at:] + resp, len(resp))
        orig = reference_logprobs(w, a, prompt + resp, len(resp))
        d64.append(skill - orig)
        scale = max(scale, skill.abs().max().item(), orig.abs().max().item())
    d64 = torch.cat(d64).numpy()
    sig = signal(advantages, lam) if advantages else None
    kernel_backend = "auto" if device.type == "cuda" else "torch"
    P, S, T, R = shape["P"], shape["S"], shape["T"], shape["R"]
    one = P + S + 2 * T + 2 * R  # fork tokens of one step-sample
    cases = []
    for dtype_name in DTYPES:
        chunks = _megatron_model(a, getattr(torch, dtype_name), kernel_backend)
        weights.load_hf_weights(chunks, a, w)
        rows = _arrangements(chunks, reqs, empty, one)
        ref = _deltas(rows[0][2]())
        against = {name: kind for name, _, _, kind in rows}
        runs_as = "megatron-core model, " + ("Triton kernels" if device.type == "cuda" else "torch path")
        methods = [Method(name, role, runs_as, lambda call=call, name=name: (name, _deltas(call())))
                   for name, role, call, _ in rows]

        def error(res, against=against, ref=ref):
            name, d = res
            out = {}
            if against[name] != "none":
                out.update(quantiles(d - (ref if against[name] == "ref" else 0.0), "noise"))
                if sig is not None:
                    out.update(buried(sig, sig["lambda"]["episode"], out["noise_p99"]))
            if against[name] != "zero":  # an empty skill's float64 Δ is 0: its noise is the error
                out["float64_max"] = float(np.abs(d - d64).max())
            return out

        notes = [f"Δ of this model in float64 over {d64.size} tokens: " + _fmt_q(quantiles(d64, "delta"))]
        # logprob_scale: the largest |log-prob| Δ is a difference of (its rounding is relative to that)
        extra = {"placement": PLACEMENT, "delta_float64": quantiles(d64, "delta"), "logprob_scale": scale}
        if sig is not None:
            extra["signal"] = {k: v for k, v in sig.items() if k != "_sorted"}
            notes.append(f"the run's |λΔ| ({sig['env']}, {sig['model']} in {sig['model_dtype']}: {sig['tokens']} skill "
                         f"tokens of {sig['step_samples']} step-samples, {sig['iterations']} iterations, λ "
                         f"{sig['lambda']}): " + _fmt_q(extra["signal"]) +
                         "; buried_*: its tokens (and their share of Σ|λΔ|) at or below λ x a row's noise p99")
        cases.append(Case(f"Δ {dtype_name}", dict(shape, samples=len(reqs), tokens=int(d64.size)), dtype_name, 0,
                          methods, error, extra=dict(extra, notes=notes)))
    return cases


OPS = {
    "delta_noise": ("the noise floor of Δ: the same step-samples scored in other packings, layouts and with an empty "
                    "skill, per dtype (fp32, bf16, fp16), beside a run's |λΔ| (--advantages)", delta_noise_cases),
}
