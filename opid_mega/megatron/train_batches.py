"""PPO training micro-batches from the C++ batch builder, with no per-sample Python on the way.

A rollout batch's training inputs are kept as flat arrays (:class:`TrainData`: every step-sample's prompt +
response tokens concatenated, and per response token the old log-probs, advantages and reference log-probs). A
mini-batch is an index array (:meth:`TrainData.subset`, vectorised gathers); its micro-batches come from
``opid_mega.batching.build_train_batches`` (``opid_mega._C`` when built, else the numpy reference): token-budget
packing balanced over the data-parallel ranks (largest first onto the least-loaded micro-batch, the same number of
micro-batches on every rank). :meth:`TrainData.micro_batches` returns this rank's share as
:class:`~opid_mega.megatron.logprobs.PackedBatch` es (``opid_mega.megatron.logprobs.plain_batches``, the packing
every plain-layout caller shares), the per-token values aligned with the gathered rows by one scatter through the
builder's ``ctx_gather_start``. A sequence longer than the budget gets a micro-batch of its own (the budget is
raised to the longest sequence).

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

from opid_mega.batching.layout import csr_offsets, csr_ranges
from opid_mega.megatron.logprobs import VALUE_KEYS as LOGPROB_VALUE_KEYS
from opid_mega.megatron.logprobs import PackedBatch, empty_batch, plain_batches, rank_batches

# the values TrainData carries (logprobs.VALUE_KEYS but loss_mask, which the layout decides)
VALUE_KEYS = tuple(k for k in LOGPROB_VALUE_KEYS if k != "loss_mask")


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
    # optional skill contexts, as the record keeps them (opid_mega.experience): sample s owns skill contexts
    # skill_offsets[s]:skill_offsets[s+1]; skill context e inserts section e
    # (section_tokens[section_offsets[e]:section_offsets[e+1]]) into the sample's prompt before token insert_at[e],
    # then loses its first drop[e] tokens (optional, default 0: algo.truncate_skill_context)
    skill_offsets: Optional[np.ndarray] = None
    insert_at: Optional[np.ndarray] = None
    section_offsets: Optional[np.ndarray] = None
    section_tokens: Optional[np.ndarray] = None
    drop: Optional[np.ndarray] = None

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
        given = [x is not None for x in (self.skill_offsets, self.insert_at, self.section_offsets,
                                         self.section_tokens)]
        if not any(given):
            if self.drop is not None:
                raise ValueError("drop is given without skill contexts")
            return
        if not all(given):
            raise ValueError("skill contexts need skill_offsets, insert_at, section_offsets and section_tokens "
                             "together")
        self.skill_offsets, self.insert_at, self.section_offsets = (
            np.ascontiguousarray(x, np.int64) for x in (self.skill_offsets, self.insert_at, self.section_offsets))
        self.section_tokens = np.ascontiguousarray(self.section_tokens, np.int32)
        self.drop = (np.zeros(self.insert_at.size, np.int64) if self.drop is None
                     else np.ascontiguousarray(self.drop, np.int64))
        self.contexts()  # every error of the columns, named, at construction

    def contexts(self):
        """Every sample's original context then its skill contexts (`opid_mega.batching.layout.skill_contexts`)."""
        from opid_mega.batching.layout import skill_contexts

        return skill_contexts(self.tokens, self.seq_offsets, np.diff(self.seq_offsets) - self.resp_lens,
                              self.skill_offsets, self.insert_at, self.section_offsets, self.section_tokens,
                              self.drop)

    @property
    def has_skills(self) -> bool:
        return self.skill_offsets is not None and int(self.skill_offsets[-1]) > 0

    @classmethod
    def from_sequences(cls, seqs: Sequence[Sequence[int]], resp_lens: Sequence[int],
                       skills: Optional[Sequence[dict]] = None, **values) -> "TrainData":
        """From token lists (prompt + response each) and response lengths; values flat over responses.
        ``skills[s]``: sample s's skill contexts as {kind: (insert_at, section token list)}, in sorted kind order."""
        lens = np.fromiter(map(len, seqs), np.int64, count=len(seqs))
        tokens = _int32_tokens(seqs, lens)
        cols = {}
        if skills is not None:
            if len(skills) != len(seqs):
                raise ValueError(f"skills has {len(skills)} entries for {len(seqs)} samples")
            sections = [sec for per in skills for _, sec in (per[k] for k in sorted(per))]
            slens = np.fromiter(map(len, sections), np.int64, count=len(sections))
            cols = dict(skill_offsets=csr_offsets(np.fromiter(map(len, skills), np.int64, count=len(skills))),
                        insert_at=np.array([per[k][0] for per in skills for k in sorted(per)], np.int64),
                        section_offsets=csr_offsets(slens), section_tokens=_int32_tokens(sections, slens))
        return cls(tokens, csr_offsets(lens), np.asarray(resp_lens, np.int64), values, **cols)

    @property
    def num_samples(self) -> int:
        return int(self.seq_offsets.size - 1)

    def subset(self, idx) -> "TrainData":
        """The samples ``idx`` (in that order), by vectorised gathers."""
        idx = np.asarray(idx, np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_samples):
            raise IndexError(f"sample indices must lie in [0, {self.num_samples})")
        seq_lens = np.diff(self.seq_offsets)[idx]
        tok = csr_ranges(self.seq_offsets[idx], seq_lens)
        val = csr_ranges(csr_offsets(self.resp_lens)[idx], self.resp_lens[idx])
        skills = {}
        if self.skill_offsets is not None:
            per = np.diff(self.skill_offsets)[idx]
            ctx = csr_ranges(self.skill_offsets[idx], per)
            slens = np.diff(self.section_offsets)[ctx]
            skills = dict(skill_offsets=csr_offsets(per), insert_at=self.insert_at[ctx], section_offsets=csr_offsets(slens),
                          section_tokens=self.section_tokens[csr_ranges(self.section_offsets[ctx], slens)],
                          drop=self.drop[ctx])
        return TrainData(self.tokens[tok], csr_offsets(seq_lens), self.resp_lens[idx],
                         {k: v[val] for k, v in self.values.items()}, **skills)

    def micro_batches(self, budget: int, num_ranks: int = 1, rank: int = 0,
                      backend: Optional[str] = None) -> list[PackedBatch]:
        """This rank's micro-batches of at most ``budget`` tokens (or the longest sequence), balanced over
        ``num_ranks`` ranks; every rank gets the same number (an empty one is :func:`empty_batch`)."""
        if not 0 <= rank < num_ranks:
            raise ValueError(f"rank {rank} is not in [0, {num_ranks})")
        if self.num_samples == 0:
            return [empty_batch()]
        if self.has_skills:
            return self._fork_micro_batches(budget, num_ranks, rank, backend)
        return plain_batches((self.tokens, self.seq_offsets, self.resp_lens), budget, num_ranks, rank,
                             values=self.values, backend=backend).batches

    def _fork_micro_batches(self, budget: int, num_ranks: int, rank: int, backend: Optional[str]) -> list[PackedBatch]:
        """Fork-layout micro-batches: per sample its original context, then its skill contexts (module docstring)."""
        from opid_mega.batching import build_fork_batches

        ctx = self.contexts()
        sample_offsets = ctx.sample_offsets
        is_orig = np.zeros(ctx.num_contexts, bool)
        is_orig[sample_offsets[:-1]] = True
        owner = np.repeat(np.arange(self.num_samples), np.diff(sample_offsets))
        orig_ctx = sample_offsets[:-1]
        lens = np.diff(ctx.ctx_offsets)
        need = int(np.add.reduceat(lens, sample_offsets[:-1]).max())  # a sample never leaves its micro-batch
        pb = build_fork_batches(ctx, max(int(budget), need), num_ranks, backend=backend)
        f = pb.flat
        pos = csr_ranges(f["ctx_gather_start"][orig_ctx], self.resp_lens)  # the original contexts' gathered rows
        m_total = int(f["gather_rows"].size)
        gathered = {}
        for k, v in list(self.values.items()) + [("loss_mask", np.ones(int(self.resp_lens.sum()), np.float32))]:
            g = np.zeros(m_total, np.float32)
            g[pos] = v
            gathered[k] = torch.from_numpy(g)
        pairs = np.stack([np.flatnonzero(~is_orig), sample_offsets[:-1][owner[~is_orig]]], axis=1)
        per_mb_pairs, _ = pb.pair_positions(pairs)
        return rank_batches(pb, rank, gathered, ctx.resp_lens, per_mb_pairs)


def _int32_tokens(seqs, lens: np.ndarray) -> np.ndarray:
    tokens = np.fromiter(itertools.chain.from_iterable(seqs), np.int64, count=int(lens.sum()))
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(np.int32).max):
        raise ValueError("token ids must lie in [0, 2^31)")
    return tokens.astype(np.int32)
