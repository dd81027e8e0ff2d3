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

import torch


@dataclass
class ScoreRequest:
    """One step-sample: its rollout prompt, its response, and the skill sections to score it with.

    `skills[kind] = (insert_at, section_ids)`: the skill context is
    `prompt_ids[:insert_at] + section_ids + prompt_ids[insert_at:] + response_ids`.
    """

    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    skills: dict = field(default_factory=dict)

    def __post_init__(self):
        for kind, (at, _section) in self.skills.items():
            if not 0 <= at <= len(self.prompt_ids):
                raise ValueError(f"ScoreRequest: skill {kind!r} insert_at={at} outside the prompt "
                                 f"(0..{len(self.prompt_ids)})")
        if len(self.prompt_ids) == 0:
            raise ValueError("ScoreRequest: empty prompt")

    def context(self, kind: str | None) -> list[int]:
        """The token ids of the original context (kind None) or of one skill context."""
        p = list(self.prompt_ids)
        if kind is not None:
            at, section = self.skills[kind]
            p = p[:at] + list(section) + p[at:]
        return p + list(self.response_ids)


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
        seqs: list[tuple[list[int], int]] = []
        index: list[tuple[int, str | None]] = []
        for i, r in enumerate(requests):
            for kind in [None, *sorted(r.skills)]:
                ctx = r.context(kind)
                seqs.append((ctx, len(ctx) - len(r.response_ids)))
                index.append((i, kind))
        self.last_tokens = sum(len(t) for t, _ in seqs)
        lps = self.logprob_fn(seqs, temperature=self.temperature) if seqs else []
        results = [ScoreResult(orig=torch.empty(0), skill={}) for _ in requests]
        for (i, kind), lp in zip(index, lps):
            if kind is None:
                results[i].orig = lp
            else:
                results[i].skill[kind] = lp
        return results
