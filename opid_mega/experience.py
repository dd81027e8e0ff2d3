"""One iteration's step-samples as one columnar record, built once and filled stage by stage.

    exp = Experience.from_rollout(batch, iteration, policy_version)   rollout: tokens, lengths, groups, scores, ...
    exp.ref_logprobs = ...                                             reference: log π_ref of every response token
    add_skills(exp, analyses, ...)                                     experience: routing, sections, audit (once)
    score(exp, scorer, ...)                                            score: old and skill-context log-probs
    advantages(exp, algo_cfg)                                          advantages: A_out per sample, A per token
                                                                       (or algo.advantage_fn; check_advantages)
    exp.train_data(...)                                                train: the policy's view of the same columns
    metrics(exp, ...)                                                  metrics: a function of the record

Columns (S step-samples in trajectory order, R = Σ response tokens, C = skill contexts):

    traj_index, step_index   int64 [S]     which kept trajectory / step a sample is
    tokens, seq_offsets      int32 [Σ P+R], int64 [S+1]   prompt then response, CSR
    prompt_lens, resp_lens   int64 [S]
    groups                   int64 [S]     GRPO group (task index in the batch)
    scores                   float64 [S]   the trajectory's outcome R
    invalid                  bool [S]      the response broke the answer format
    engine_logprobs          float64 [R]   what the rollout engine reported while sampling
    policy_version           int64 [S]     the weight version the sample was drawn with
    skill_offsets            int64 [S+1]   CSR of the skill contexts per sample (kind order: episode, step)
    skill_kinds              list [C]      "episode" / "step"
    skill_insert_at          int64 [C]     token index in the prompt where the section goes
    skill_drop               int64 [C]     leading tokens cut from the augmented prompt (algo.truncate_skill_context)
    section_offsets, section_tokens        CSR of each context's section token ids
    ref_logprobs             float32 [R]   the frozen reference (None without one)
    old_logprobs             float32 [R]   the old policy on the original context (PPO's old log-probs)
    skill_logprobs[kind]     float32 [R]   the old policy on the kind's skill context (= old where not routed)
    routed[kind]             bool [S]      the sample was scored with a skill of that kind
    divergence[kind]         float32 [R]   algo.delta full_kl / topk_kl: the divergence term of that context
    a_out                    float64 [S]   outcome advantage
    token_advantages         float32 [R]   A = A_out + Σ_k λ_k Δ_k

Nothing here knows Megatron: the record is numpy; the scorer and the policy are called through their interfaces.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from opid_mega import algo
from opid_mega.batching.layout import ContextBatch, csr_offsets, csr_ranges, skill_contexts
from opid_mega.scoring.scorer import Scores
from opid_mega.skills.injection import anchor, inject_skills, render_skill_section
from opid_mega.skills.sanitize import cut_to_tokens

KINDS = (algo.EPISODE, algo.STEP)


def _cat_int32(seqs) -> np.ndarray:
    seqs = list(seqs)
    return np.fromiter((x for q in seqs for x in q), np.int32) if seqs else np.zeros(0, np.int32)


@dataclass
class Experience:
    iteration: int
    trajectories: list  # the kept trajectories (Trajectory): no env error, not cut by the rollout deadline
    rollout_trajectories: int  # every trajectory the rollout produced
    env_errors: int
    deadline_trajectories: int
    traj_index: np.ndarray
    step_index: np.ndarray
    tokens: np.ndarray
    seq_offsets: np.ndarray
    prompt_lens: np.ndarray
    resp_lens: np.ndarray
    groups: np.ndarray
    scores: np.ndarray
    invalid: np.ndarray
    engine_logprobs: np.ndarray
    policy_version: np.ndarray
    steps: list = field(repr=False, default_factory=list)  # the StepSample of each row (texts for the audit)
    analyses: list = field(default_factory=list)  # one Analysis or None per kept trajectory
    skill_offsets: Optional[np.ndarray] = None
    skill_kinds: list = field(default_factory=list)
    skill_insert_at: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    skill_drop: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    section_offsets: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int64))
    section_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    ref_logprobs: Optional[torch.Tensor] = None
    old_logprobs: Optional[np.ndarray] = None
    skill_logprobs: dict = field(default_factory=dict)
    routed: dict = field(default_factory=dict)
    divergence: dict = field(default_factory=dict)
    a_out: Optional[np.ndarray] = None
    token_advantages: Optional[np.ndarray] = None
    behavior_weights: Optional[np.ndarray] = None
    scored_tokens: int = 0  # tokens the scorer ran through the model

    # ---- construction ----------------------------------------------------------------------------------------
    @classmethod
    def from_rollout(cls, batch, iteration: int, policy_version: int) -> "Experience":
        """The record of a RolloutBatch: every step-sample of every trajectory that neither hit an env error nor the
        rollout deadline (a simulator fault or a cut episode is no outcome), trajectory-major."""
        all_trajs = batch.trajectories
        trajs = [t for t in all_trajs if not t.env_error and not t.deadline_failure]
        rows = [(ti, si, s) for ti, t in enumerate(trajs) for si, s in enumerate(t.steps)]
        steps = [s for _, _, s in rows]
        plens = np.fromiter((len(s.prompt_ids) for s in steps), np.int64, count=len(steps))
        rlens = np.fromiter((len(s.response_ids) for s in steps), np.int64, count=len(steps))
        S = len(rows)
        return cls(
            iteration=iteration, trajectories=trajs, rollout_trajectories=len(all_trajs),
            env_errors=sum(t.env_error for t in all_trajs),
            deadline_trajectories=sum(t.deadline_failure for t in all_trajs),
            traj_index=np.fromiter((ti for ti, _, _ in rows), np.int64, count=S),
            step_index=np.fromiter((si for _, si, _ in rows), np.int64, count=S),
            tokens=_cat_int32(list(s.prompt_ids) + list(s.response_ids) for s in steps),
            seq_offsets=csr_offsets(plens + rlens), prompt_lens=plens, resp_lens=rlens,
            groups=np.fromiter((trajs[ti].group_id for ti, _, _ in rows), np.int64, count=S),
            scores=np.fromiter((trajs[ti].score for ti, _, _ in rows), np.float64, count=S),
            invalid=np.fromiter((not s.valid for s in steps), bool, count=S),
            engine_logprobs=np.fromiter((x for s in steps for x in s.response_logprobs), np.float64),
            policy_version=np.full(S, policy_version, np.int64), steps=steps,
            skill_offsets=np.zeros(S + 1, np.int64))

    # ---- views -----------------------------------------------------------------------------------------------
    @property
    def num_samples(self) -> int:
        return int(self.resp_lens.size)

    def sequence(self, s: int) -> np.ndarray:
        return self.tokens[self.seq_offsets[s]:self.seq_offsets[s + 1]]

    def prompt(self, s: int) -> np.ndarray:
        return self.sequence(s)[:self.prompt_lens[s]]

    def response(self, s: int) -> np.ndarray:
        return self.sequence(s)[self.prompt_lens[s]:]

    def sample_id(self, s: int) -> str:
        ti = int(self.traj_index[s])
        return f"{self.iteration}/{self.trajectories[ti].task_id}/{ti}/s{int(self.step_index[s])}"

    def contexts(self, s: int) -> dict:
        """{kind: (insert_at, section token list)} of sample s's skill contexts (a per-sample view for tests and
        the audit; the stages read the columns)."""
        own = range(self.skill_offsets[s], self.skill_offsets[s + 1])
        return {self.skill_kinds[c]: (int(self.skill_insert_at[c]),
                                      self.section_tokens[self.section_offsets[c]:self.section_offsets[c + 1]].tolist())
                for c in own}

    def scoring_contexts(self, skills: bool = True) -> ContextBatch:
        """The contexts a scorer scores, as one CSR batch: every sample's original context, then (`skills`) its skill
        contexts in the record's order (opid_mega.batching.layout.skill_contexts: the one place where insertion
        points become tokens; the training batches come through it too)."""
        if not skills or not self.skill_kinds:
            n = self.num_samples
            return skill_contexts(self.tokens, self.seq_offsets, self.prompt_lens, np.zeros(n + 1, np.int64),
                                  np.zeros(0, np.int64), np.zeros(1, np.int64), np.zeros(0, self.tokens.dtype))
        return skill_contexts(self.tokens, self.seq_offsets, self.prompt_lens, self.skill_offsets,
                              self.skill_insert_at, self.section_offsets, self.section_tokens, self.skill_drop)

    def skill_columns(self) -> dict:
        """The skill contexts as the policy's training view takes them (TrainData's skill_* keyword arguments)."""
        return dict(skill_offsets=self.skill_offsets, insert_at=self.skill_insert_at,
                    section_offsets=self.section_offsets, section_tokens=self.section_tokens, drop=self.skill_drop)

    @property
    def outcome_per_token(self) -> np.ndarray:
        return np.repeat(self.a_out, self.resp_lens)

    def response_slice(self, s: int) -> slice:
        start = int(self.resp_lens[:s].sum())
        return slice(start, start + int(self.resp_lens[s]))


# ---- the experience stage: analyses -> routed, fitted, audited skill contexts ------------------------------------
def skill_section_cap(encode, kind: str, max_skill_tokens: int) -> int:
    """Tokens a skill section of `kind` may take: its fixed frame (title, instruction, brackets; measured with a
    one-character skill) plus analyzer.max_skill_tokens for the skill plus 4 for tokenizer merges at the frame's
    edges. `Trainer.fit_section` enforces it, and the fork scorer's budget is derived from it."""
    return len(encode(render_skill_section("x", kind))) + int(max_skill_tokens) + 4


class SectionFitter:
    """`fit(skill, kind) -> (skill, token ids of its section)`, the section at most `caps[kind]` tokens
    (skill_section_cap; `encode`: text -> token ids, tokenized like the rollout prompts' pieces). A skill already cut
    to analyzer.max_skill_tokens fits; should tokenizer merges at the frame's edges make it longer, the skill is cut
    further (word boundary), so the fork scorer's budget always holds."""

    def __init__(self, encode: Callable[[str], list], max_skill_tokens: int):
        self.encode = encode
        self.caps = {k: skill_section_cap(encode, k, max_skill_tokens) for k in KINDS}

    def __call__(self, skill: str, kind: str) -> tuple[str, list]:
        ids = self.encode(render_skill_section(skill, kind))
        cap = self.caps[kind]
        if len(ids) > cap:
            skill, _ = cut_to_tokens(skill, cap, lambda t: len(self.encode(render_skill_section(t, kind))))
            ids = self.encode(render_skill_section(skill, kind))
        return skill, ids


def add_skills(exp: Experience, analyses: list, algo_cfg, fit_section: Callable, audit=None,
               max_prompt_tokens: Optional[int] = None) -> None:
    """Routes each kept trajectory's analysis to its step-samples (algo.route_skills by algo.routing and the use_*
    switches), fits every skill into its section budget (`fit_section(skill, kind) -> (skill, section ids)`; an
    empty section is dropped) and audits each augmented prompt, once. grpo / skill_grpo score no skill context.
    algo.truncate_skill_context: an augmented prompt longer than `max_prompt_tokens` (rollout.max_prompt_tokens)
    keeps its last max_prompt_tokens tokens, as the reference's left truncation does (skill_drop)."""
    truncate = bool(getattr(algo_cfg, "truncate_skill_context", False))
    if truncate and (max_prompt_tokens is None or max_prompt_tokens < 1):
        raise ValueError("algo.truncate_skill_context needs max_prompt_tokens (rollout.max_prompt_tokens) >= 1, "
                         f"got {max_prompt_tokens!r}")
    exp.analyses = list(analyses)
    per_traj: list = []
    for t, an in zip(exp.trajectories, exp.analyses):
        if an is None:
            per_traj.append([{} for _ in t.steps])
            continue
        steps = {k: v for k, v in an.step_skills.items() if 0 <= k < len(t.steps)}
        per_traj.append(algo.route_skills(len(t.steps), steps, an.episode_skill, mode=algo_cfg.routing,
                                          use_episode=algo_cfg.use_episode, use_step=algo_cfg.use_step,
                                          lambda_episode=algo_cfg.lambda_episode,
                                          lambda_step=algo_cfg.lambda_step))
    # one route per row (a padded copy takes its original's)
    routes = [per_traj[int(ti)][int(si)] for ti, si in zip(exp.traj_index, exp.step_index)]
    if algo_cfg.mode in ("grpo", "skill_grpo"):  # no λΔ term: only the original context is scored
        routes = [{} for _ in routes]
    per_sample, kinds, at_list, sections, drops = [], [], [], [], []
    for s, (step, route) in enumerate(zip(exp.steps, routes)):
        n = 0
        for kind, skill in sorted(route.items()):  # contexts in kind order, as the scorers take them
            at = (step.episode_insert_at, step.step_insert_at)[anchor(kind, algo_cfg.placement)]
            skill, ids = fit_section(skill, kind)
            if not ids:
                continue
            kinds.append(kind)
            at_list.append(at)
            sections.append(ids)
            drops.append(max(0, int(exp.prompt_lens[s]) + len(ids) - int(max_prompt_tokens)) if truncate else 0)
            n += 1
            if audit is not None:
                audit.log_augmented_prompt(iteration=exp.iteration, sample_id=exp.sample_id(s), kind=kind,
                                           placement=algo_cfg.placement, skill=skill,
                                           prompt=inject_skills(step.prompt_text, {kind: skill}, algo_cfg.placement),
                                           stage="scoring")
        per_sample.append(n)
    exp.skill_offsets = csr_offsets(per_sample)
    exp.skill_kinds = kinds
    exp.skill_insert_at = np.asarray(at_list, np.int64)
    exp.skill_drop = np.asarray(drops, np.int64)
    exp.section_offsets = csr_offsets([len(x) for x in sections])
    exp.section_tokens = _cat_int32(sections)


def pad_to_multiple(exp: Experience, divisor: int, rng: np.random.Generator) -> int:
    """The reference's batch padding (train.pad_batch): when the record's step-samples are not a multiple of
    `divisor` (micro-batch size x data-parallel world), append copies of randomly drawn distinct step-samples
    (opid_mega.batching.balance.padding_indices) until they are. A copy is a full step-sample of its trajectory
    (same group and score), so it enters the group's outcome statistics, the skill routing and the loss like the
    reference's duplicate. Call it on a fresh record, before any stage. Returns the number of copies."""
    from opid_mega.batching.balance import padding_indices

    if exp.analyses or exp.old_logprobs is not None or exp.skill_kinds:
        raise ValueError("pad_to_multiple: the record has already been through a stage; pad a fresh record")
    idx = padding_indices(exp.num_samples, int(divisor), rng)
    if not idx.size:
        return 0
    rows = np.concatenate([np.arange(exp.num_samples), idx])
    resp_at = csr_offsets(exp.resp_lens)
    exp.engine_logprobs = np.concatenate([exp.engine_logprobs[resp_at[s]:resp_at[s + 1]] for s in rows])
    seqs = [exp.sequence(int(s)) for s in rows]
    exp.tokens = np.concatenate(seqs).astype(np.int32, copy=False)
    exp.seq_offsets = csr_offsets([len(x) for x in seqs])
    for name in ("traj_index", "step_index", "prompt_lens", "resp_lens", "groups", "scores", "invalid",
                 "policy_version"):
        setattr(exp, name, getattr(exp, name)[rows])
    exp.steps = [exp.steps[int(s)] for s in rows]
    exp.skill_offsets = np.zeros(len(rows) + 1, np.int64)
    return int(idx.size)


def minibatch_order(exp: Experience, ranks: int, mini_batch_size: int) -> np.ndarray:
    """The reference's mini-batch composition (train.balance_ranks): the step-sample order whose consecutive
    `mini_batch_size` slices are its mini-batches after balancing the batch's tokens (prompt + response) over
    `ranks` data-parallel partitions (opid_mega.batching.balance.reference_minibatch_order)."""
    from opid_mega.batching.balance import reference_minibatch_order

    return reference_minibatch_order((exp.prompt_lens + exp.resp_lens).tolist(), int(ranks), int(mini_batch_size))


# ---- the score stage ----------------------------------------------------------------------------------------------
def reference(exp: Experience, scorer) -> None:
    """reference: ref_logprobs, the original contexts scored by `scorer` (one packer for every context; the caller
    holds the reference weights in the model)."""
    exp.ref_logprobs = torch.from_numpy(scorer.score(exp.scoring_contexts(skills=False)).logprobs)


def fill_scores(exp: Experience, scores: Scores, delta: str = "sampled") -> None:
    """A scorer's output over exp.scoring_contexts() into the record's columns: old log-probs (each sample's
    original context), every kind's skill log-probs (the old ones where the sample was not routed to the kind)
    and, for algo.delta full_kl / topk_kl, the divergence term (0 where not routed)."""
    S, lens = exp.num_samples, exp.resp_lens
    per = np.diff(exp.skill_offsets) if exp.skill_kinds else np.zeros(S, np.int64)
    first = csr_offsets(per + 1)[:-1]  # each sample's original context
    is_skill = np.ones(S + int(per.sum()), bool)
    is_skill[first] = False
    ctx_resp = np.repeat(lens, per + 1)
    at = csr_offsets(ctx_resp)
    if scores.logprobs.shape != (int(at[-1]),):
        raise ValueError(f"the scorer returned {scores.logprobs.size} log-probs for the {int(at[-1])} response tokens "
                         f"of {S} step-samples' {ctx_resp.size} contexts")
    exp.old_logprobs = scores.logprobs[csr_ranges(at[first], lens)].astype(np.float32)
    owner = np.repeat(np.arange(S), per)  # the sample of each skill context (record order)
    skill_ctx = np.flatnonzero(is_skill)  # their context indices
    resp_at = csr_offsets(lens)
    kinds = np.asarray(exp.skill_kinds, dtype=object)
    div_at = csr_offsets(lens[owner])
    for kind in KINDS:
        mine = np.flatnonzero(kinds == kind) if kinds.size else np.zeros(0, np.int64)
        exp.routed[kind] = np.zeros(S, bool)
        exp.routed[kind][owner[mine]] = True
        dest = csr_ranges(resp_at[owner[mine]], lens[owner[mine]])
        col = exp.old_logprobs.copy()
        col[dest] = scores.logprobs[csr_ranges(at[skill_ctx[mine]], lens[owner[mine]])]
        exp.skill_logprobs[kind] = col
        if delta != "sampled":
            if not scores.divergence and mine.size:
                raise ValueError(f"algo.delta={delta}: the scorer returned no divergence for skill type {kind!r} "
                                 "(scoring.scorer must be fork)")
            src = csr_ranges(div_at[mine], lens[owner[mine]])
            rows = {k: torch.from_numpy(np.asarray(v)[src]).double() for k, v in scores.divergence.items()
                    if k != "topk_ids"} if mine.size else {}
            term = np.zeros(int(lens.sum()), np.float32)
            if mine.size:
                term[dest] = algo.delta_baseline(rows, delta).float().numpy()
            exp.divergence[kind] = term


def score(exp: Experience, scorer, delta: str = "sampled") -> None:
    """score: the old weights on the original context (PPO's old log-probs) and every routed skill context."""
    scores = scorer.score(exp.scoring_contexts())
    fill_scores(exp, scores, delta)
    exp.scored_tokens = scores.tokens


# ---- the advantages stage -----------------------------------------------------------------------------------------
def advantages(exp: Experience, a, backend: Optional[str] = None) -> None:
    """A_out per sample and A = A_out + Σ_k λ_k Δ_k per response token (docs/algorithm.md §2, §6, §7), by the batch
    builder (`opid_mega._C` when built; `backend` forces one). `a` is the AlgoConfig: grpo / skill_grpo take no Δ;
    every other mode adds λ_k Δ_k with Δ_k = skill − original log-prob on the samples routed to kind k
    (algo.delta=sampled, the paper), or that plus the divergence term (full_kl / topk_kl). Identical to GRPO
    whenever every Δ is 0."""
    from opid_mega import batching

    scores = np.asarray(exp.scores, np.float64) - a.invalid_penalty * np.asarray(exp.invalid, bool)
    exp.a_out = batching.outcome_advantage(scores, np.asarray(exp.groups, np.int64), a.outcome_mode, backend=backend)
    exp.token_advantages = with_skill_term(exp, a, exp.a_out, backend=backend)


def with_skill_term(exp: Experience, a, a_out: np.ndarray, backend: Optional[str] = None) -> np.ndarray:
    """float32 [Σ resp_lens]: A = a_out + Σ_k λ_k Δ_k per response token, the skill term exactly as `advantages`
    adds it (a.mode, λ, algo.delta, delta_normalize, delta_clip) to any outcome advantage `a_out` (float64 [S]):
    what a custom algo.advantage_fn that changes only the outcome part calls (docs/custom_algo.md)."""
    from opid_mega import batching

    old = exp.old_logprobs
    deltas, masks, lambdas = [], [], []
    if a.mode not in ("grpo", "skill_grpo"):
        lam = {algo.EPISODE: a.lambda_episode if a.use_episode else 0.0,
               algo.STEP: a.lambda_step if a.use_step else 0.0}
        for kind in KINDS:
            masks.append(exp.routed[kind])
            d = exp.skill_logprobs[kind].astype(np.float64) - old
            if a.delta != "sampled":  # + the divergence term (its conditional mean removed)
                d = d + exp.divergence[kind].astype(np.float64)
            deltas.append(d)
            lambdas.append(lam[kind])
    return batching.token_advantages(a_out, exp.resp_lens, deltas, masks, lambdas, normalize=a.delta_normalize,
                                     clip=a.delta_clip, groups=np.asarray(exp.groups, np.int64),
                                     share_cap=a.skill_share_cap, backend=backend)


def off_policy(exp: Experience, correction: str, cap: float) -> None:
    """off-policy (every iteration: a record is stale under train.max_staleness > 0, or restored by a resume under a
    smaller bound): behavior_weights, per token min(π_prox / π_behaviour, cap) on the samples drawn with older
    weights than the ones that rescored them (correction=decoupled; opid_mega.algo.off_policy), 1
    on the others and everywhere with correction=none. The policy trains on token_advantages x behavior_weights."""
    w = np.ones(int(exp.resp_lens.sum()), np.float64)
    stale = np.repeat(exp.policy_version < exp.iteration - 1, exp.resp_lens)
    if correction == "decoupled" and stale.any():
        if exp.engine_logprobs.size != w.size:
            raise ValueError("train.off_policy_correction=decoupled needs the rollout engine's log-probs of every "
                             f"response token (got {exp.engine_logprobs.size} for {w.size} tokens)")
        w[stale] = algo.behavior_weights(exp.old_logprobs[stale], exp.engine_logprobs[stale], cap)
    exp.behavior_weights = w


def check_advantages(exp: Experience, name: str) -> None:
    """What an advantage function (`name`: algo.advantage_fn) filled: exp.a_out float64 [S] and
    exp.token_advantages float32 [Σ resp_lens], every value finite; else a ValueError naming the function."""
    expected = (("a_out", np.float64, exp.num_samples, "one per step-sample"),
                ("token_advantages", np.float32, int(exp.resp_lens.sum()), "one per response token"))
    for column, dtype, n, what in expected:
        v = getattr(exp, column)
        want = f"a numpy {np.dtype(dtype).name} array of {n} values ({what})"
        if not isinstance(v, np.ndarray):
            raise ValueError(f"algo.advantage_fn={name}: exp.{column} is {type(v).__name__}, expected {want}")
        if v.dtype != dtype or v.shape != (n,):
            raise ValueError(f"algo.advantage_fn={name}: exp.{column} is {v.dtype} of shape {v.shape}, expected "
                             f"{want}")
        bad = np.flatnonzero(~np.isfinite(v))
        if bad.size:
            raise ValueError(f"algo.advantage_fn={name}: exp.{column}[{int(bad[0])}] is {v[bad[0]]} "
                             f"({bad.size} non-finite values), expected finite values")


# ---- the metrics stage ------------------------------------------------------------------------------------------
def mean(xs) -> float:
    xs = list(xs)
    return float(sum(xs) / len(xs)) if xs else float("nan")


def outcome_info_means(trajs: list, prefix: str) -> dict:
    """{prefix/key: share of trajectories whose last value of the env's info key was truthy} for every key of the
    trajectories' outcome_info (the env's `info_metrics`; a trajectory without the key counts as False)."""
    keys = sorted({k for t in trajs for k in t.outcome_info})
    return {f"{prefix}/{k}": mean(bool(t.outcome_info.get(k)) for t in trajs) for k in keys} if trajs else {}


def metrics(exp: Experience, elapsed: float) -> dict:
    """The record's metrics: outcomes, rollout counts, advantage magnitudes, the engine/trainer log-prob mismatch
    and the tokens per second of an iteration that took `elapsed` seconds."""
    trajs = exp.trajectories
    ntok = max(int(exp.resp_lens.sum()), 1)
    out_tok = exp.outcome_per_token
    out_abs = float(np.abs(out_tok).sum() / ntok)
    # A is rounded to float32 once: against A_out in float32, GRPO's skill part is exactly 0
    skill_abs = float(np.abs(exp.token_advantages.astype(np.float64) - out_tok.astype(np.float32)).sum() / ntok)
    eng, old = exp.engine_logprobs, exp.old_logprobs
    return {
        "train/success_rate": mean(t.won for t in trajs),
        "train/score": mean(t.score for t in trajs),
        "train/episode_length": mean(len(t.steps) for t in trajs),
        "train/invalid_rate": float(exp.invalid.mean()),
        **outcome_info_means(trajs, "train"),
        "train/step_samples": exp.num_samples,
        "rollout/trajectories": exp.rollout_trajectories,
        "rollout/env_errors": exp.env_errors,
        "rollout/deadline_trajectories": exp.deadline_trajectories,
        "adv/outcome_abs_mean": out_abs,
        "adv/skill_abs_mean": skill_abs,
        "adv/skill_share": skill_abs / (out_abs + skill_abs) if out_abs + skill_abs > 0 else 0.0,
        "rollout/logprob_mismatch": float(np.abs(eng - old).sum() / ntok) if eng.size == old.size else None,
        "perf/tokens_per_s": int(exp.seq_offsets[-1]) / elapsed,
        # weight versions between the one that drew a sample and the one that trains on it (train.max_staleness)
        "rollout/staleness": int((exp.iteration - 1 - exp.policy_version).max()) if exp.num_samples else 0,
        **behavior_metrics(exp),
    }


def behavior_metrics(exp: Experience) -> dict:
    """The behaviour weights of the stale samples' tokens (none: no metrics)."""
    stale = np.repeat(exp.policy_version < exp.iteration - 1, exp.resp_lens)
    if exp.behavior_weights is None or not stale.any():
        return {}
    w = exp.behavior_weights[stale]
    return {"train/behavior_weight_mean": float(w.mean()), "train/behavior_weight_max": float(w.max())}


def advantage_records(exp: Experience) -> list:
    """logging.dump_advantages: one JSON-able record per step-sample (task, group, score, A_out, the skill kinds it
    was scored with, response token ids and Δ = skill − original log-prob per token of each kind)."""
    out = []
    for s, step in enumerate(exp.steps):
        t = exp.trajectories[int(exp.traj_index[s])]
        sl = exp.response_slice(s)
        kinds = sorted(k for k in KINDS if exp.routed[k][s])
        out.append({"iteration": exp.iteration, "sample": exp.sample_id(s), "task": t.task_id,
                    "group": int(t.group_id), "score": float(t.score), "won": bool(t.won),
                    "step": int(exp.step_index[s]), "action": step.action, "valid": bool(step.valid),
                    "a_out": round(float(exp.a_out[s]), 6), "kinds": kinds,
                    "response_ids": [int(x) for x in exp.response(s)],
                    "delta": {k: [round(float(x), 5) for x in (exp.skill_logprobs[k][sl].astype(np.float64)
                                                                - exp.old_logprobs[sl].astype(np.float64))]
                              for k in kinds}})
    return out


def scores_of_results(exp: Experience, results: list) -> Scores:
    """Per-sample ScoreResults (tests, benchmarks) as the scorer's columns over `exp`: the record's skill contexts
    become the results' kinds (each sample's contexts in kind order), and the returned Scores hold each sample's
    original log-probs then its skill log-probs. A result whose length is not its sample's response's is a
    ValueError naming the sample."""
    lens = exp.resp_lens
    kinds = [sorted(r.skill) for r in results]
    for i, r in enumerate(results):
        for what, t in [("original", r.orig)] + [(f"{k}-skill", r.skill[k]) for k in kinds[i]]:
            if t.numel() != lens[i]:
                raise ValueError(f"the {what} log-probs of step-sample {i} has {t.numel()} values, its response "
                                 f"{int(lens[i])} tokens")
    exp.skill_offsets, exp.skill_kinds = csr_offsets([len(k) for k in kinds]), [k for ks in kinds for k in ks]
    parts = [t for r, ks in zip(results, kinds) for t in [r.orig] + [r.skill[k] for k in ks]]
    keys = sorted({key for r in results for d in r.divergence.values() for key in d})
    divergence = {key: np.concatenate([r.divergence[k][key].double().numpy() for r, ks in zip(results, kinds)
                                       for k in ks]) for key in keys}
    return Scores(torch.cat([t.reshape(-1).float() for t in parts]).numpy() if parts else np.zeros(0, np.float32),
                  divergence)


def compute_advantages(a, results: list, scores, invalid, groups, backend: Optional[str] = None) -> Experience:
    """The advantages stage on scorer results alone (tests, benchmarks): a record holding only the columns it
    reads (one ScoreResult, outcome score, invalid flag and group per step-sample; `a` the AlgoConfig)."""
    S = len(results)
    lens = np.fromiter((r.orig.numel() for r in results), np.int64, count=S)
    exp = Experience(
        iteration=0, trajectories=[], rollout_trajectories=0, env_errors=0, deadline_trajectories=0,
        traj_index=np.zeros(S, np.int64), step_index=np.zeros(S, np.int64), tokens=np.zeros(0, np.int32),
        seq_offsets=np.zeros(S + 1, np.int64), prompt_lens=np.zeros(S, np.int64), resp_lens=lens,
        groups=np.asarray(groups, np.int64), scores=np.asarray(scores, np.float64),
        invalid=np.asarray(invalid, bool), engine_logprobs=np.zeros(0), policy_version=np.zeros(S, np.int64))
    fill_scores(exp, scores_of_results(exp, results), a.delta if a.mode not in ("grpo", "skill_grpo") else "sampled")
    advantages(exp, a, backend=backend)
    return exp
