"""The `Scorer` interface: per step-sample, the old policy's log-probs of the response under the original context
(PPO's old log-probs) and under each skill-augmented context (docs/algorithm.md §6).

`NaiveScorer` runs every context as its own sequence (the reference code's way, and the benchmark baseline);
`opid_mega.scoring.fork_scorer.ForkScorer` scores all contexts of a step-sample in one forward over the fork layout.
Both take the model through one function, `logprob_fn`, so the scorer knows no Megatron.

Temperature: every context is scored at the rollout's sampling temperature T (log-probs of softmax(logits / T), as
the sampler saw them; docs/algorithm.md "Reference rules in detail"), so the original context gives exactly PPO's old
log-probs and Δ compares two distributions at the same T. A scorer is built with `temperature=T` and hands it to its
model function as the keyword `temperature=` on every call (1.0: the plain softmax).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import numpy as np
import torch

from opid_mega.batching.layout import ContextBatch, csr_offsets, skill_contexts


@dataclass
class ScoreRequest:
    """One step-sample: its rollout prompt, its response, and the skill sections to score it with.

    `skills[kind] = (insert_at, section_ids)`: the skill context is
    `prompt_ids[:insert_at] + section_ids + prompt_ids[insert_at:] + response_ids`, less its first `drop[kind]`
    tokens (default 0; algo.truncate_skill_context: the augmented prompt left-truncated as the reference does).
    """

    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    skills: dict = field(default_factory=dict)
    drop: dict = field(default_factory=dict)

    def __post_init__(self):
        for kind, (at, _section) in self.skills.items():
            if not 0 <= at <= len(self.prompt_ids):
                raise ValueError(f"ScoreRequest: skill {kind!r} insert_at={at} outside the prompt "
                                 f"(0..{len(self.prompt_ids)})")
        if len(self.prompt_ids) == 0:
            raise ValueError("ScoreRequest: empty prompt")
        for kind, n in self.drop.items():
            if kind not in self.skills:
                raise ValueError(f"ScoreRequest: drop given for {kind!r}, which has no skill context")
            if not 0 <= n < len(self.prompt_ids) + len(self.skills[kind][1]):
                raise ValueError(f"ScoreRequest: drop[{kind!r}]={n} must leave at least one prompt token "
                                 f"(0..{len(self.prompt_ids) + len(self.skills[kind][1]) - 1})")


def context_batch(requests: Sequence[ScoreRequest]) -> tuple[ContextBatch, list]:
    """(contexts, kinds): every request's original context then its skill contexts in sorted kind order, as one
    CSR batch built from the insertion points (`opid_mega.batching.layout.skill_contexts`); kinds[i] is
    `[None, *sorted(kinds)]` of request i, one entry per context."""
    kinds = [[None, *sorted(r.skills)] for r in requests]
    seqs = [np.asarray(list(r.prompt_ids) + list(r.response_ids), np.int64) for r in requests]
    sections = [r.skills[k] for r, ks in zip(requests, kinds) for k in ks[1:]]
    sec_ids = [np.asarray(list(ids), np.int64) for _, ids in sections]
    tokens = np.concatenate(seqs) if seqs else np.zeros(0, np.int64)
    ctx = skill_contexts(tokens, csr_offsets([x.size for x in seqs]), [len(r.prompt_ids) for r in requests],
                         csr_offsets([len(ks) - 1 for ks in kinds]), [at for at, _ in sections],
                         csr_offsets([x.size for x in sec_ids]),
                         np.concatenate(sec_ids) if sec_ids else np.zeros(0, np.int64),
                         [r.drop.get(k, 0) for r, ks in zip(requests, kinds) for k in ks[1:]])
    return ctx, kinds


@dataclass
class ScoreResult:
    orig: torch.Tensor  # float32 [R]: log π_old(y_t | h, y_<t)
    skill: dict  # kind -> float32 [R]: log π_old(y_t | h ⊕ s_kind, y_<t)
    # kind -> the divergences of that skill context against the original one, per response token (ForkScorer with
    # divergence_topk set): dual_context_divergence's keys, e.g. "kl_orig_skill" float32 [R] = KL(p_o ‖ p_s)
    divergence: dict = field(default_factory=dict)


# logprob_fn(sequences, temperature=T) -> log-probs: for each (tokens, score_from), the float32 log-probs of
# tokens[score_from:] under softmax(logits / T).
LogprobFn = Callable[..., list[torch.Tensor]]


def check_temperature(temperature: float, who: str) -> float:
    t = float(temperature)
    if not (0 < t < float("inf")):
        raise ValueError(f"{who}: temperature must be a finite number > 0 (the rollout's sampling temperature), "
                         f"got {temperature!r}")
    return t


class Scorer(Protocol):
    def score(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]: ...


class NaiveScorer:
    """Every context is its own sequence: 2P+2T+2R+S tokens for a dual-context step-sample."""

    name = "naive"

    def __init__(self, logprob_fn: LogprobFn, temperature: float = 1.0):
        self.logprob_fn = logprob_fn
        self.temperature = check_temperature(temperature, "NaiveScorer")
        self.last_tokens = 0  # tokens run through the model by the last score() call

    def score(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        ctx, kinds = context_batch(requests)
        seqs = [(ctx.tokens[ctx.ctx_offsets[c]:ctx.ctx_offsets[c + 1]].tolist(),
                 int(ctx.ctx_offsets[c + 1] - ctx.ctx_offsets[c] - ctx.resp_lens[c])) for c in range(ctx.num_contexts)]
        index = [(i, kind) for i, ks in enumerate(kinds) for kind in ks]
        self.last_tokens = sum(len(t) for t, _ in seqs)
        lps = self.logprob_fn(seqs, temperature=self.temperature) if seqs else []
        results = [ScoreResult(orig=torch.empty(0), skill={}) for _ in requests]
        for (i, kind), lp in zip(index, lps):
            if kind is None:
                results[i].orig = lp
            else:
                results[i].skill[kind] = lp
        return results
