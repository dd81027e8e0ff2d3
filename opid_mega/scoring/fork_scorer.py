"""`ForkScorer`: all contexts of a step-sample in ONE forward that computes their shared prefix once.

Each step-sample's contexts (original + one per skill) become one fork group `[prefix | branch ...]`
(`opid_mega.batching.layout`); step-samples with identical prompts (step 0 of every trajectory of a GRPO group)
share one prefix. Groups are packed into micro-batches of at most `max_tokens` tokens and handed to
`packed_logprob_fn`, which runs the model over each packed micro-batch (positions, branch ids and `cu_seqlens`
drive RoPE and the fork attention) and returns the log-probs of its `gather_rows` -> `gather_targets` at the
sampling temperature it is given (`temperature=` keyword, as for NaiveScorer's logprob_fn).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
import torch

from opid_mega.scoring.scorer import ScoreRequest, ScoreResult, check_temperature, context_batch

# packed_logprob_fn(micro_batches, temperature=T) -> one float32 tensor [M_b] per micro-batch: the log-probs of
# `gather_targets` read at hidden rows `gather_rows` (see opid_mega.batching.MicroBatch) under softmax(logits / T).
PackedLogprobFn = Callable[..., list[torch.Tensor]]


class ForkScorer:
    name = "fork"

    def __init__(self, packed_logprob_fn: PackedLogprobFn, max_tokens: int = 8192, share_prompts: bool = True,
                 temperature: float = 1.0, divergence_topk: Optional[int] = None):
        if max_tokens < 1:
            raise ValueError(f"ForkScorer: max_tokens={max_tokens} must be >= 1")
        if divergence_topk is not None and (int(divergence_topk) != divergence_topk or divergence_topk < 0):
            raise ValueError(f"ForkScorer: divergence_topk={divergence_topk!r} must be None or an integer >= 0")
        # None: log-probs only (the paper's Δ). k >= 0: also the divergences of every skill context against the
        # original one (ScoreResult.divergence; k > 0 adds the top-k of the skill side)
        self.divergence_topk = divergence_topk
        self.packed_logprob_fn = packed_logprob_fn
        self.temperature = check_temperature(temperature, "ForkScorer")
        self.max_tokens = max_tokens
        self.share_prompts = share_prompts
        self.last_tokens = 0  # tokens run through the model by the last score() call
        self.last_naive_tokens = 0  # what the naive scorer would have run
        self.last_shared_fraction = 0.0

    def pack(self, requests: Sequence[ScoreRequest]):
        """(PackedBatches, kinds per request) for `requests` (C++ batch builder when built)."""
        from opid_mega.batching import build_fork_batches

        contexts, kinds = context_batch(requests)
        packed = build_fork_batches(contexts, self.max_tokens, 1, share_prompts=self.share_prompts)
        return packed, kinds

    def score(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        if not requests:
            return []
        packed, kinds = self.pack(requests)
        mbs = packed.micro_batches(0)
        self.last_tokens = int(sum(mb.num_tokens for mb in mbs))
        self.last_naive_tokens = int(packed.num_naive_tokens)
        self.last_shared_fraction = float(packed.shared_fraction)
        if self.divergence_topk is None:
            flats = self.packed_logprob_fn(mbs, temperature=self.temperature)
        else:  # every (skill context, original context) pair of a sample: its rows lie in one micro-batch
            pairs = [(int(packed.sample_offsets[i]) + j, int(packed.sample_offsets[i]))
                     for i, ks in enumerate(kinds) for j in range(1, len(ks))]
            per_mb, starts = packed.pair_positions(np.array(pairs, np.int64).reshape(-1, 2))
            outs = self.packed_logprob_fn(mbs, temperature=self.temperature, pairs=per_mb,
                                          topk=self.divergence_topk)
            if len(outs) != len(mbs):
                raise RuntimeError(f"packed_logprob_fn returned {len(outs)} results for {len(mbs)} micro-batches")
            flats = [o["logprobs"] for o in outs]
        if len(flats) != len(mbs):
            raise RuntimeError(f"packed_logprob_fn returned {len(flats)} results for {len(mbs)} micro-batches")
        for b, (mb, f) in enumerate(zip(mbs, flats)):
            if f.numel() != len(mb.gather_rows):
                raise RuntimeError(f"micro-batch {b}: {f.numel()} log-probs for {len(mb.gather_rows)} rows")
        values = packed.unpack_logprobs([f.detach().float().cpu().numpy() for f in flats])
        results = []
        for ks, per_ctx in zip(kinds, values):
            by_kind = {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in zip(ks, per_ctx)}
            orig = by_kind.pop(None)
            results.append(ScoreResult(orig=orig, skill=by_kind))
        if self.divergence_topk is not None:
            ctx_mb = packed.flat["ctx_micro_batch"]
            p = 0
            for i, (ks, r) in enumerate(zip(kinds, results)):
                for kind in ks[1:]:
                    k, n = int(ctx_mb[pairs[p][1]]), r.orig.numel()
                    s0 = int(starts[p])
                    r.divergence[kind] = {key: v[s0:s0 + n] for key, v in outs[k].items() if key != "logprobs"}
                    p += 1
        return results
