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

from opid_mega.batching.layout import ContextBatch
from opid_mega.scoring.scorer import Scores, check_temperature, skill_context_index

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
