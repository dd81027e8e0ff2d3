"""The `Scorer` interface: the old policy's log-probs of every step-sample's response under its original context
(PPO's old log-probs) and under each skill-augmented context (docs/algorithm.md §6), as columns.

A scorer takes a `ContextBatch` (opid_mega.batching.layout: CSR tokens, one original context per sample then its
skill contexts, built from a record's columns by `layout.skill_contexts`, the one function that turns insertion
points into tokens) and returns `Scores`: one flat float32 array of every context's response log-probs,
context-major, plus (fork scorer with divergences) each skill context's divergences against its sample's original
context. No per-sample objects: the record's columns go in, columns come out (opid_mega.experience.score).

`NaiveScorer` runs every context as its own sequence (the reference code's way, and the benchmark baseline);
`ForkScorer` scores all contexts of a step-sample in one forward over the fork layout (below).
Both take the model through one function, so the scorer knows no Megatron.

Temperature: every context is scored at the rollout's sampling temperature T (log-probs of softmax(logits / T), as
the sampler saw them; docs/algorithm.md "Reference rules in detail"), so the original context gives exactly PPO's old
log-probs and Δ compares two distributions at the same T. A scorer is built with `temperature=T` and hands it to its
model function as the keyword `temperature=` on every call (1.0: the plain softmax).

`ScoreRequest` / `context_batch` build a ContextBatch from Python lists (tests and benchmarks).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence

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
    """One step-sample's scores as tensors (the input of experience.compute_advantages in tests and benchmarks)."""

    orig: torch.Tensor  # float32 [R]: log π_old(y_t | h, y_<t)
    skill: dict  # kind -> float32 [R]: log π_old(y_t | h ⊕ s_kind, y_<t)
    # kind -> the divergences of that skill context against the original one, per response token (ForkScorer with
    # divergence_topk set): dual_context_divergence's keys, e.g. "kl_orig_skill" float32 [R] = KL(p_o ‖ p_s)
    divergence: dict = field(default_factory=dict)


@dataclass
class Scores:
    """A scorer's output over a ContextBatch `ctx`.

    logprobs float32 [Σ_c ctx.resp_lens[c]]: context c's response log-probs at csr_offsets(ctx.resp_lens)[c].
    divergence: key -> float32 [Σ over skill contexts of their resp_len], the skill contexts (every context but the
    first of its sample) in context order: their divergences against the sample's first (original) context
    (dual_context_divergence's keys; empty unless the scorer computes them). tokens: tokens run through the model.
    """

    logprobs: np.ndarray
    divergence: dict = field(default_factory=dict)
    tokens: int = 0


def skill_context_index(ctx: ContextBatch) -> np.ndarray:
    """int64: the indices of the skill contexts of `ctx` (every context that is not the first of its sample)."""
    first = np.zeros(ctx.num_contexts, bool)
    first[ctx.sample_offsets[:-1][np.diff(ctx.sample_offsets) > 0]] = True
    return np.flatnonzero(~first)


def score_requests(scorer, requests: Sequence["ScoreRequest"]) -> list:
    """`scorer` over Python-list requests, one ScoreResult per request (tests and benchmarks; the trainer's stages
    hand the scorer the record's columns)."""
    ctx, kinds = context_batch(requests)
    return per_sample(ctx, kinds, scorer.score(ctx))


def per_sample(ctx: ContextBatch, kinds: Sequence[list], scores: Scores) -> list:
    """`scores` as one ScoreResult per sample (`kinds[i]`: context_batch's kinds of sample i): a view for tests."""
    at = csr_offsets(ctx.resp_lens)
    skill_at = {int(c): j for j, c in enumerate(skill_context_index(ctx))}
    div_at = csr_offsets(ctx.resp_lens[skill_context_index(ctx)])
    out = []
    for i, ks in enumerate(kinds):
        c0 = int(ctx.sample_offsets[i])
        vals = {k: torch.from_numpy(np.ascontiguousarray(scores.logprobs[at[c0 + j]:at[c0 + j + 1]], np.float32))
                for j, k in enumerate(ks)}
        res = ScoreResult(orig=vals.pop(None), skill=vals)
        for j, k in enumerate(ks[1:], start=1):
            e = skill_at[c0 + j]
            if scores.divergence:
                res.divergence[k] = {key: torch.from_numpy(v[div_at[e]:div_at[e + 1]])
                                     for key, v in scores.divergence.items()}
        out.append(res)
    return out


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
    def score(self, contexts: ContextBatch) -> Scores: ...


def flat_logprobs(parts: Sequence[torch.Tensor], lens: np.ndarray, what: str) -> np.ndarray:
    """float32 concatenation of one tensor per context, each checked to hold that context's `lens[c]` values."""
    got = np.fromiter((t.numel() for t in parts), np.int64, count=len(parts))
    if got.shape != lens.shape or np.any(got != lens):
        bad = int(np.flatnonzero(got != lens)[0]) if got.shape == lens.shape else -1
        raise RuntimeError(f"{what}: {len(parts)} results for {lens.size} contexts" if bad < 0 else
                           f"{what}: context {bad} got {int(got[bad])} log-probs for {int(lens[bad])} response tokens")
    return torch.cat([t.detach().reshape(-1).float().cpu() for t in parts]).numpy() if parts else \
        np.zeros(0, np.float32)


class NaiveScorer:
    """Every context is its own sequence: 2P+2T+2R+S tokens for a dual-context step-sample."""

    name = "naive"

    def __init__(self, logprob_fn: LogprobFn, temperature: float = 1.0):
        self.logprob_fn = logprob_fn
        self.temperature = check_temperature(temperature, "NaiveScorer")

    def score(self, contexts: ContextBatch) -> Scores:
        ctx = contexts
        lens = np.diff(ctx.ctx_offsets)
        seqs = [(ctx.tokens[ctx.ctx_offsets[c]:ctx.ctx_offsets[c + 1]].tolist(), int(lens[c] - ctx.resp_lens[c]))
                for c in range(ctx.num_contexts)]
        lps = self.logprob_fn(seqs, temperature=self.temperature) if seqs else []
        return Scores(flat_logprobs(lps, ctx.resp_lens, "NaiveScorer"), tokens=int(lens.sum()))


# ---- the fork scorer ------------------------------------------------------------------------------------------
# packed_logprob_fn(micro_batches, temperature=T) -> one float32 tensor [M_b] per micro-batch: the log-probs of
# `gather_targets` read at hidden rows `gather_rows` (see opid_mega.batching.MicroBatch) under softmax(logits / T).
PackedLogprobFn = Callable[..., list[torch.Tensor]]


class ForkScorer:
    """All contexts of a step-sample in ONE forward that computes their shared prefix once.

    Each step-sample's contexts (original + one per skill) become one fork group `[prefix | branch ...]`
    (`opid_mega.batching.layout`); step-samples with identical prompts (step 0 of every trajectory of a GRPO group)
    share one prefix. Groups are packed into micro-batches of at most `max_tokens` tokens and handed to
    `packed_logprob_fn`, which runs the model over each packed micro-batch (positions, branch ids and `cu_seqlens`
    drive RoPE and the fork attention) and returns the log-probs of its `gather_rows` -> `gather_targets` at the
    sampling temperature it is given (`temperature=` keyword, as for NaiveScorer's logprob_fn)."""

    name = "fork"

    def __init__(self, packed_logprob_fn: PackedLogprobFn, max_tokens: int = 8192, share_prompts: bool = True,
                 temperature: float = 1.0, divergence_topk: Optional[int] = None):
        if max_tokens < 1:
            raise ValueError(f"ForkScorer: max_tokens={max_tokens} must be >= 1")
        if divergence_topk is not None and (int(divergence_topk) != divergence_topk or divergence_topk < 0):
            raise ValueError(f"ForkScorer: divergence_topk={divergence_topk!r} must be None or an integer >= 0")
        # None: log-probs only (the paper's Δ). k >= 0: also the divergences of every skill context against the
        # original one (Scores.divergence; k > 0 adds the top-k of the skill side)
        self.divergence_topk = divergence_topk
        self.packed_logprob_fn = packed_logprob_fn
        self.temperature = check_temperature(temperature, "ForkScorer")
        self.max_tokens = max_tokens
        self.share_prompts = share_prompts
        self.last_naive_tokens = 0  # what the naive scorer would have run
        self.last_shared_fraction = 0.0

    def score(self, contexts: ContextBatch) -> Scores:
        """Every context's response log-probs (and, with divergence_topk set, every skill context's divergences
        against its sample's original context) in one forward per micro-batch."""
        from opid_mega.batching import build_fork_batches

        if contexts.num_contexts == 0:
            return Scores(np.zeros(0, np.float32))
        packed = build_fork_batches(contexts, self.max_tokens, 1, share_prompts=self.share_prompts)
        mbs = packed.micro_batches(0)
        self.last_naive_tokens = int(packed.num_naive_tokens)
        self.last_shared_fraction = float(packed.shared_fraction)
        tokens = int(sum(mb.num_tokens for mb in mbs))
        if self.divergence_topk is None:
            outs = self.packed_logprob_fn(mbs, temperature=self.temperature)
            flats = outs
        else:  # every (skill context, its sample's original context) pair: its rows lie in one micro-batch
            skill = skill_context_index(contexts)
            owner = np.searchsorted(contexts.sample_offsets, skill, side="right") - 1
            pairs = np.stack([skill, contexts.sample_offsets[owner]], axis=1) if skill.size else \
                np.zeros((0, 2), np.int64)
            per_mb, starts = packed.pair_positions(pairs)
            outs = self.packed_logprob_fn(mbs, temperature=self.temperature, pairs=per_mb,
                                          topk=self.divergence_topk)
            flats = [o["logprobs"] for o in outs] if len(outs) == len(mbs) else outs
        if len(flats) != len(mbs):
            raise RuntimeError(f"packed_logprob_fn returned {len(flats)} results for {len(mbs)} micro-batches")
        for b, (mb, f) in enumerate(zip(mbs, flats)):
            if f.numel() != len(mb.gather_rows):
                raise RuntimeError(f"micro-batch {b}: {f.numel()} log-probs for {len(mb.gather_rows)} rows")
        logprobs = packed.context_values([f.detach().float().cpu().numpy() for f in flats]).astype(np.float32)
        divergence = {}
        if self.divergence_topk is not None and skill.size:
            mb_of = packed.flat["ctx_micro_batch"][pairs[:, 1]]
            lens = contexts.resp_lens[skill]
            for key in (k for k in outs[0] if k != "logprobs"):
                parts = [outs[int(k)][key].detach().cpu().numpy()[s0:s0 + n] for k, s0, n in zip(mb_of, starts, lens)]
                divergence[key] = np.concatenate(parts) if parts else np.zeros(0)
        return Scores(logprobs, divergence, tokens)
