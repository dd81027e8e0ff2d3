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
the greedy planner of ``opid_mega.megatron.logprobs.plan_micro_batches`` does).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from opid_mega.megatron.logprobs import PackedBatch, empty_batch

VALUE_KEYS = ("old_logprobs", "advantages", "ref_logprobs")


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

    def __post_init__(self):
        self.tokens = np.ascontiguousarray(self.tokens, np.int32)
        self.seq_offsets = np.ascontiguousarray(self.seq_offsets, np.int64)
        self.resp_lens = np.ascontiguousarray(self.resp_lens, np.int64)
        n = self.num_samples
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

    @classmethod
    def from_sequences(cls, seqs: Sequence[Sequence[int]], resp_lens: Sequence[int], **values) -> "TrainData":
        """From token lists (prompt + response each) and response lengths; values flat over responses."""
        lens = np.fromiter(map(len, seqs), np.int64, count=len(seqs))
        tokens = np.fromiter(itertools.chain.from_iterable(seqs), np.int64, count=int(lens.sum()))
        if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(np.int32).max):
            raise ValueError("token ids must lie in [0, 2^31)")
        return cls(tokens.astype(np.int32), _offsets(lens), np.asarray(resp_lens, np.int64), values)

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
        return TrainData(self.tokens[tok], _offsets(seq_lens), self.resp_lens[idx],
                         {k: v[val] for k, v in self.values.items()})

    def micro_batches(self, budget: int, num_ranks: int = 1, rank: int = 0,
                      backend: Optional[str] = None) -> list[PackedBatch]:
        """This rank's micro-batches of at most ``budget`` tokens (or the longest sequence), balanced over
        ``num_ranks`` ranks; every rank gets the same number (an empty one is :func:`empty_batch`)."""
        from opid_mega.batching import build_train_batches

        if not 0 <= rank < num_ranks:
            raise ValueError(f"rank {rank} is not in [0, {num_ranks})")
        if self.num_samples == 0:
            return [empty_batch()]
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
        # the samples of each micro-batch in gathered order -> their scored token counts (token_weights' split)
        order = np.lexsort((f["ctx_gather_start"], f["ctx_micro_batch"]))
        per_mb = _offsets(np.bincount(f["ctx_micro_batch"], minlength=pb.num_ranks * pb.micro_batches_per_rank))
        ones = torch.ones(int(f["gather_rows"].size), dtype=torch.float32)
        out = []
        for mb in pb.micro_batches(rank):
            k = rank * pb.micro_batches_per_rank + mb.index
            if mb.num_tokens == 0:
                out.append(empty_batch())
                continue
            m0, m1 = int(f["mb_gather_offsets"][k]), int(f["mb_gather_offsets"][k + 1])
            extras = {key: g[m0:m1] for key, g in gathered.items()}
            extras["loss_mask"] = ones[m0:m1]
            out.append(PackedBatch(
                input_ids=torch.from_numpy(mb.tokens).long()[None],
                position_ids=torch.from_numpy(mb.position_ids).long()[None],
                cu_seqlens=torch.from_numpy(np.ascontiguousarray(mb.cu_seqlens, np.int32)),
                score_rows=torch.from_numpy(mb.gather_rows).long(),
                score_targets=torch.from_numpy(mb.gather_targets).long(),
                scored_per_seq=self.resp_lens[order[per_mb[k]:per_mb[k + 1]]].tolist(),
                extras=extras))
        return out
