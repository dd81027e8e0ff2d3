"""PPO training micro-batches from the C++ batch builder, with no per-sample Python on the way.

A rollout batch's training inputs are kept as flat arrays (:class:`TrainData`: every step-sample's prompt +
response tokens concatenated, and per response token the old log-probs, advantages and reference log-probs). A
mini-batch is an index array (:meth:`TrainData.subset`, vectorised gathers); its micro-batches come from
``opid_mega.batching.build_train_batches`` (``opid_mega._C`` when built, else the numpy reference): token-budget
packing balanced over the data-parallel ranks (largest first onto the least-loaded micro-batch, the same number of
micro-batches on every rank). :meth:`TrainData.micro_batches` returns this rank's share as
:class:`~opid_mega.megatron.logprobs.PackedBatch` es, the per-token values aligned with the gathered rows by one
scatter through the builder's ``ctx_gather_start``.

A sequence longer than the budget gets a micro-batch of its own (the budget is raised to the longest sequence, as
the greedy planner of ``opid_mega.megatron.logprobs.greedy_micro_batches`` does).

Distillation (``algo.distill_coef`` > 0): samples may carry skill contexts (the same response after a skill-augmented
prompt). The micro-batches are then built in the fork layout (``opid_mega.batching.build_fork_batches``: a sample's
contexts share their prefix and never leave one micro-batch); the PPO values and loss mask sit on the original
context's rows only, and ``PackedBatch.pairs`` pairs every skill-context row with the original row of the same
token, for the divergence the loss back-propagates through the original context.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from opid_mega.megatron.logprobs import PackedBatch, empty_batch

# loss_weight: optional per-token PPO loss weights (opid_mega.algo.reference_micro_weights)
VALUE_KEYS = ("old_logprobs", "advantages", "ref_logprobs", "loss_weight")


def _offsets(lens: np.ndarray) -> np.ndarray:
    out = np.zeros(lens.size + 1, np.int64)
    np.cumsum(lens, out=out[1:])
    return out


def _ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenation of arange(starts[i], starts[i] + lens[i]) over i (int64), vectorised."""
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    return np.repeat(starts - _offsets(lens)[:-1], lens) + np.arange(total, dtype=np.int64)


@dataclass
class TrainData:
    """Training inputs of step-samples as flat arrays (sample order).

    tokens int32 [T]: prompt + response of every sample; seq_offsets int64 [S+1]; resp_lens int64 [S] (the last
    resp_lens[s] tokens of sequence s are its response, the scored tokens); values: float32 [sum resp_lens] arrays
    keyed by "old_logprobs", "advantages" (both required) and "ref_logprobs" (optional)."""

    tokens: np.ndarray
    seq_offsets: np.ndarray
    resp_lens: np.ndarray
    values: dict = field(default_factory=dict)
    # optional skill contexts (CSR): context e is skill_tokens[skill_offsets[e]:skill_offsets[e+1]] (prompt with a
    # skill section + the sample's response, resp_lens[s] tokens); sample s owns contexts
    # skill_sample_offsets[s]:skill_sample_offsets[s+1]
    skill_tokens: Optional[np.ndarray] = None
    skill_offsets: Optional[np.ndarray] = None
    skill_sample_offsets: Optional[np.ndarray] = None

    def __post_init__(self):
        self.tokens = np.ascontiguousarray(self.tokens, np.int32)
        self.seq_offsets = np.ascontiguousarray(self.seq_offsets, np.int64)
        self.resp_lens = np.ascontiguousarray(self.resp_lens, np.int64)
        n = self.num_samples
        self._check_skills()
        if self.seq_offsets.ndim != 1 or self.seq_offsets.size < 1 or self.seq_offsets[0] != 0 \
                or self.seq_offsets[-1] != self.tokens.size or np.any(np.diff(self.seq_offsets) < 0):
            raise ValueError(f"seq_offsets must rise from 0 to the {self.tokens.size} tokens")
        if self.resp_lens.shape != (n,):
            raise ValueError(f"resp_lens has shape {self.resp_lens.shape}, expected ({n},)")
        seq_lens = np.diff(self.seq_offsets)
        bad = np.flatnonzero((self.resp_lens < 0) | (self.resp_lens >= np.maximum(seq_lens, 1)))
        if bad.size:
            s = int(bad[0])
            raise ValueError(f"sample {s}: resp_len {int(self.resp_lens[s])} must be in [0, {int(seq_lens[s])}) "
                             "(at least one prompt token)")
        total = int(self.resp_lens.sum())
        for k in ("old_logprobs", "advantages"):
            if k not in self.values:
                raise ValueError(f"TrainData needs {k!r}")
        for k, v in list(self.values.items()):
            if k not in VALUE_KEYS:
                raise ValueError(f"unknown value {k!r}; allowed: {', '.join(VALUE_KEYS)}")
            if v is None:
                del self.values[k]
                continue
            v = self.values[k] = np.ascontiguousarray(v.numpy() if torch.is_tensor(v) else v, np.float32)
            if v.shape != (total,):
                raise ValueError(f"{k} has shape {v.shape}, expected ({total},) (one value per response token)")

    def _check_skills(self) -> None:
        given = [x is not None for x in (self.skill_tokens, self.skill_offsets, self.skill_sample_offsets)]
        if not any(given):
            return
        if not all(given):
            raise ValueError("skill contexts need skill_tokens, skill_offsets and skill_sample_offsets together")
        self.skill_tokens = np.ascontiguousarray(self.skill_tokens, np.int32)
        self.skill_offsets = np.ascontiguousarray(self.skill_offsets, np.int64)
        self.skill_sample_offsets = np.ascontiguousarray(self.skill_sample_offsets, np.int64)
        so, ss = self.skill_offsets, self.skill_sample_offsets
        if so.ndim != 1 or so.size < 1 or so[0] != 0 or so[-1] != self.skill_tokens.size or np.any(np.diff(so) < 0):
            raise ValueError(f"skill_offsets must rise from 0 to the {self.skill_tokens.size} skill tokens")
        if ss.shape != (self.num_samples + 1,) or ss[0] != 0 or ss[-1] != so.size - 1 or np.any(np.diff(ss) < 0):
            raise ValueError(f"skill_sample_offsets must rise from 0 to the {so.size - 1} skill contexts, one entry "
                             f"per sample + 1 ({self.num_samples + 1})")
        owner = np.repeat(np.arange(self.num_samples), np.diff(ss))
        r = self.resp_lens[owner]
        lens = np.diff(so)
        bad = np.flatnonzero(lens <= r)
        if bad.size:
            e = int(bad[0])
            raise ValueError(f"skill context {e} of sample {int(owner[e])} has {int(lens[e])} tokens, not more than "
                             f"the sample's {int(r[e])}-token response")
        ends_s = so[1:]
        ends_o = self.seq_offsets[1:][owner]
        same = (self.skill_tokens[_ranges(ends_s - r, r)] == self.tokens[_ranges(ends_o - r, r)]) if r.sum() else \
            np.ones(0, bool)
        if not same.all():
            e = int(owner[np.searchsorted(_offsets(r)[1:], np.flatnonzero(~same)[0], side="right")])
            raise ValueError(f"a skill context of sample {e} does not end with the sample's response")

    @property
    def has_skills(self) -> bool:
        return self.skill_offsets is not None and self.skill_offsets.size > 1

    @classmethod
    def from_sequences(cls, seqs: Sequence[Sequence[int]], resp_lens: Sequence[int],
                       skill_contexts: Optional[Sequence[Sequence[Sequence[int]]]] = None, **values) -> "TrainData":
        """From token lists (prompt + response each) and response lengths; values flat over responses.
        ``skill_contexts[s]``: sample s's skill contexts as token lists (skill-augmented prompt + the same response)."""
        lens = np.fromiter(map(len, seqs), np.int64, count=len(seqs))
        tokens = _int32_tokens(seqs, lens)
        skills = {}
        if skill_contexts is not None:
            if len(skill_contexts) != len(seqs):
                raise ValueError(f"skill_contexts has {len(skill_contexts)} entries for {len(seqs)} samples")
            skills = cls.skill_columns(skill_contexts)
        return cls(tokens, _offsets(lens), np.asarray(resp_lens, np.int64), values, **skills)

    @staticmethod
    def skill_columns(skill_contexts: Sequence[Sequence[Sequence[int]]]) -> dict:
        """The skill_* constructor arguments of per-sample skill contexts (token lists)."""
        flat = [c for per in skill_contexts for c in per]
        clens = np.fromiter(map(len, flat), np.int64, count=len(flat))
        return dict(skill_tokens=_int32_tokens(flat, clens), skill_offsets=_offsets(clens),
                    skill_sample_offsets=_offsets(np.fromiter(map(len, skill_contexts), np.int64,
                                                              count=len(skill_contexts))))

    @property
    def num_samples(self) -> int:
        return int(self.seq_offsets.size - 1)

    def subset(self, idx) -> "TrainData":
        """The samples ``idx`` (in that order), by vectorised gathers."""
        idx = np.asarray(idx, np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_samples):
            raise IndexError(f"sample indices must lie in [0, {self.num_samples})")
        seq_lens = np.diff(self.seq_offsets)[idx]
        tok = _ranges(self.seq_offsets[idx], seq_lens)
        val = _ranges(_offsets(self.resp_lens)[idx], self.resp_lens[idx])
        skills = {}
        if self.skill_offsets is not None:
            per = np.diff(self.skill_sample_offsets)[idx]
            ctx = _ranges(self.skill_sample_offsets[idx], per)
            clens = np.diff(self.skill_offsets)[ctx]
            skills = dict(skill_tokens=self.skill_tokens[_ranges(self.skill_offsets[ctx], clens)],
                          skill_offsets=_offsets(clens), skill_sample_offsets=_offsets(per))
        return TrainData(self.tokens[tok], _offsets(seq_lens), self.resp_lens[idx],
                         {k: v[val] for k, v in self.values.items()}, **skills)

    def micro_batches(self, budget: int, num_ranks: int = 1, rank: int = 0,
                      backend: Optional[str] = None) -> list[PackedBatch]:
        """This rank's micro-batches of at most ``budget`` tokens (or the longest sequence), balanced over
        ``num_ranks`` ranks; every rank gets the same number (an empty one is :func:`empty_batch`)."""
        from opid_mega.batching import build_train_batches

        if not 0 <= rank < num_ranks:
            raise ValueError(f"rank {rank} is not in [0, {num_ranks})")
        if self.num_samples == 0:
            return [empty_batch()]
        if self.has_skills:
            return self._fork_micro_batches(budget, num_ranks, rank, backend)
        budget = max(int(budget), int(np.diff(self.seq_offsets).max()))
        pb = build_train_batches(self.tokens, self.seq_offsets, self.resp_lens, budget, num_ranks, backend=backend)
        f = pb.flat
        # every response token's place among the gathered rows (sample s's tokens start at ctx_gather_start[s])
        pos = _ranges(f["ctx_gather_start"], self.resp_lens)
        gathered = {}
        for k, v in self.values.items():
            g = np.empty_like(v)
            g[pos] = v
            gathered[k] = torch.from_numpy(g)
        gathered["loss_mask"] = torch.ones(int(f["gather_rows"].size), dtype=torch.float32)
        return _rank_batches(pb, rank, gathered, self.resp_lens)

    def _fork_micro_batches(self, budget: int, num_ranks: int, rank: int, backend: Optional[str]) -> list[PackedBatch]:
        """Fork-layout micro-batches: per sample its original context, then its skill contexts (module docstring)."""
        from opid_mega.batching import build_fork_batches
        from opid_mega.batching.layout import ContextBatch

        S = self.num_samples
        n_skill = np.diff(self.skill_sample_offsets)
        per = 1 + n_skill  # contexts per sample
        sample_offsets = _offsets(per)
        orig_ctx = sample_offsets[:-1]
        is_orig = np.zeros(int(sample_offsets[-1]), bool)
        is_orig[orig_ctx] = True
        owner = np.repeat(np.arange(S), per)
        # context c's tokens in the pool [orig tokens | skill tokens]: an orig context is its sequence; the j-th
        # skill context of sample s is skill context skill_sample_offsets[s] + j - 1
        skill_idx = np.cumsum(~is_orig) - 1
        seq_lens, skill_lens = np.diff(self.seq_offsets), np.diff(self.skill_offsets)
        starts = np.where(is_orig, self.seq_offsets[:-1][owner],
                          self.tokens.size + self.skill_offsets[:-1][np.maximum(skill_idx, 0)])
        lens = np.where(is_orig, seq_lens[owner], skill_lens[np.maximum(skill_idx, 0)])
        pool = np.concatenate([self.tokens, self.skill_tokens])
        ctx = ContextBatch(np.ascontiguousarray(pool[_ranges(starts, lens)]), _offsets(lens),
                           np.ascontiguousarray(self.resp_lens[owner]), sample_offsets)
        need = int(np.add.reduceat(lens, sample_offsets[:-1]).max())  # a sample never leaves its micro-batch
        pb = build_fork_batches(ctx, max(int(budget), need), num_ranks, backend=backend)
        f = pb.flat
        pos = _ranges(f["ctx_gather_start"][orig_ctx], self.resp_lens)  # the original contexts' gathered rows
        m_total = int(f["gather_rows"].size)
        gathered = {}
        for k, v in list(self.values.items()) + [("loss_mask", np.ones(int(self.resp_lens.sum()), np.float32))]:
            g = np.zeros(m_total, np.float32)
            g[pos] = v
            gathered[k] = torch.from_numpy(g)
        pairs = np.stack([np.flatnonzero(~is_orig), sample_offsets[:-1][owner[~is_orig]]], axis=1)
        per_mb_pairs, _ = pb.pair_positions(pairs)
        return _rank_batches(pb, rank, gathered, ctx.resp_lens, per_mb_pairs)


def _rank_batches(pb, rank: int, gathered: dict, ctx_resp_lens: np.ndarray, per_mb_pairs=None) -> list[PackedBatch]:
    """`rank`'s micro-batches of the builder output `pb` as PackedBatches: the gathered per-token values sliced per
    micro-batch, each context's scored count in gathered order (`scored_per_seq`, token_weights' split), and the row
    pairs of micro-batch k (`per_mb_pairs[k]`, from `PackedBatches.pair_positions`) when given."""
    f = pb.flat
    order = np.lexsort((f["ctx_gather_start"], f["ctx_micro_batch"]))
    per_mb = _offsets(np.bincount(f["ctx_micro_batch"], minlength=pb.num_ranks * pb.micro_batches_per_rank))
    out = []
    for mb in pb.micro_batches(rank):
        k = rank * pb.micro_batches_per_rank + mb.index
        if mb.num_tokens == 0:
            out.append(empty_batch())
            continue
        m0, m1 = int(f["mb_gather_offsets"][k]), int(f["mb_gather_offsets"][k + 1])
        b = PackedBatch.from_micro_batch(mb)
        b.scored_per_seq = ctx_resp_lens[order[per_mb[k]:per_mb[k + 1]]].tolist()
        b.extras = {key: g[m0:m1] for key, g in gathered.items()}
        if per_mb_pairs is not None:
            b.pairs = torch.from_numpy(np.stack(per_mb_pairs[k]).astype(np.int64))
        out.append(b)
    return out


def _int32_tokens(seqs, lens: np.ndarray) -> np.ndarray:
    tokens = np.fromiter(itertools.chain.from_iterable(seqs), np.int64, count=int(lens.sum()))
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(np.int32).max):
        raise ValueError("token ids must lie in [0, 2^31)")
    return tokens.astype(np.int32)
