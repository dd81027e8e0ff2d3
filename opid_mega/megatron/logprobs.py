"""Packed forward + vocabulary-parallel log-probs (and entropy) of given response tokens.

A :class:`PackedBatch` is one micro-batch: several sequences packed in ONE row (no padding compute), per-token
positions restarting at 0 for each sequence (or fork-layout positions/branch ids from the scoring batch builder),
and the rows whose next-token log-prob is wanted (``score_rows``, ``score_targets``). The last pipeline stage turns
those rows into log-probs with ``opid_mega.kernels.fused_logprobs`` over its vocabulary shard (max / sum-exp /
target-logit all-reduced over TP); the full-vocabulary logits never exist. ``temperature`` (default 1.0) gives the
log-probs (and entropy) of softmax(logits / T): pass the rollout's sampling temperature so old, new, reference and
skill-context log-probs are those of the distribution the sampler drew from (docs/algorithm.md "Reference rules in
detail").

:func:`forward_step` and :func:`logprob_loss_func` are plain megatron-core schedule callbacks: hand them to
``get_forward_backward_func()`` with ``forward_only=True``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from opid_mega.megatron.attention import ForkPackedSeqParams, packed_seq_params


@dataclass
class Sample:
    """One sequence: log-probs are wanted for tokens[score_from:] (score_from >= 1).

    Training fields (per scored token, length len(tokens) - score_from) are optional for scoring."""
    tokens: Sequence[int]
    score_from: int
    old_logprobs: Optional[Sequence[float]] = None
    advantages: Optional[Sequence[float]] = None
    ref_logprobs: Optional[Sequence[float]] = None
    loss_mask: Optional[Sequence[float]] = None

    def __post_init__(self):
        n = len(self.tokens)
        if not 1 <= self.score_from <= n:
            raise ValueError(f"score_from={self.score_from} must be in [1, {n}] for a sequence of {n} tokens")

    @property
    def n_scored(self) -> int:
        return len(self.tokens) - self.score_from


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # int64 [1, N]
    position_ids: torch.Tensor  # int64 [1, N]
    cu_seqlens: torch.Tensor  # int32 [G+1]
    score_rows: torch.Tensor  # int64 [n]: hidden row whose next token is scored
    score_targets: torch.Tensor  # int64 [n]
    scored_per_seq: list[int]  # split of the n scored tokens back into sequences
    branch_ids: Optional[torch.Tensor] = None  # int32 [N]; fork layout only
    extras: dict = field(default_factory=dict)  # float32 [n] tensors: old_logprobs, advantages, ref_logprobs, mask
    # int64 [2, P] (fork layout): indices into the n scored rows of P (skill, original) row pairs that score the same
    # response token under a skill context and the original one; the last stage then also returns their
    # divergences (opid_mega.kernels.dual_context_divergence)
    pairs: Optional[torch.Tensor] = None

    def packed_seq_params(self, device=None) -> ForkPackedSeqParams:
        """The batch's layout as megatron-core ``PackedSeqParams`` (thd) for ``model(packed_seq_params=...)``;
        build it from the host batch (its host facts then cost no device sync), branch ids go to ``device``."""
        return packed_seq_params(self.cu_seqlens, self.branch_ids, device=device)

    @classmethod
    def from_micro_batch(cls, mb) -> "PackedBatch":
        """A fork-layout micro-batch (`opid_mega.batching.MicroBatch`, or a dict with the same keys) as one packed
        row whose single "sequence" is every gathered row: the result is one flat tensor of log-probs [M]."""
        def get(key, dtype=torch.long):
            x = mb.get(key) if isinstance(mb, dict) else getattr(mb, key)
            return None if x is None else torch.as_tensor(x).to(dtype)

        rows = get("gather_rows")
        return cls(get("tokens")[None], get("position_ids")[None], get("cu_seqlens", torch.int32), rows,
                   get("gather_targets"), [int(rows.numel())], get("branch_ids", torch.int32))

    def to(self, device) -> "PackedBatch":
        mv = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
        return PackedBatch(mv(self.input_ids), mv(self.position_ids), mv(self.cu_seqlens), mv(self.score_rows),
                           mv(self.score_targets), self.scored_per_seq, mv(self.branch_ids),
                           {k: mv(v) for k, v in self.extras.items()}, mv(self.pairs))


def pack(samples: Sequence[Sample]) -> PackedBatch:
    """Pack samples into one row; the log-prob of token j is read from hidden row j-1 of its sequence."""
    if not samples:
        raise ValueError("pack: no samples")
    ids, pos, rows, tgts, cu, per = [], [], [], [], [0], []
    extras = {k: [] for k in ("old_logprobs", "advantages", "ref_logprobs", "loss_mask")}
    for s in samples:
        off = cu[-1]
        ids.extend(int(t) for t in s.tokens)
        pos.extend(range(len(s.tokens)))
        rows.extend(off + j - 1 for j in range(s.score_from, len(s.tokens)))
        tgts.extend(int(t) for t in s.tokens[s.score_from:])
        cu.append(off + len(s.tokens))
        per.append(s.n_scored)
        for k in extras:
            v = getattr(s, k)
            if v is None:
                v = [1.0] * s.n_scored if k == "loss_mask" else None
            if v is not None and len(v) != s.n_scored:
                raise ValueError(f"{k} has {len(v)} values, the sample scores {s.n_scored} tokens")
            extras[k] = None if v is None or extras[k] is None else extras[k] + list(v)
    return PackedBatch(
        input_ids=torch.tensor([ids], dtype=torch.long), position_ids=torch.tensor([pos], dtype=torch.long),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32), score_rows=torch.tensor(rows, dtype=torch.long),
        score_targets=torch.tensor(tgts, dtype=torch.long), scored_per_seq=per,
        extras={k: torch.tensor(v, dtype=torch.float32) for k, v in extras.items() if v is not None},
    )


def empty_batch() -> PackedBatch:
    """A one-token micro-batch that scores nothing (pads schedules that need a minimum micro-batch count)."""
    e = torch.zeros(0, dtype=torch.long)
    return PackedBatch(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long),
                       torch.tensor([0, 1], dtype=torch.int32), e, e, [],
                       extras={k: torch.zeros(0) for k in ("old_logprobs", "advantages", "ref_logprobs",
                                                            "loss_mask")})


def pad_batch(b: PackedBatch, length: int) -> PackedBatch:
    """``b`` extended to ``length`` tokens by one extra packed segment that attends only to itself and is
    never scored."""
    n = int(b.input_ids.shape[1])
    if n >= length:
        return b
    extra = length - n
    ids = torch.cat([b.input_ids, torch.zeros(1, extra, dtype=b.input_ids.dtype)], dim=1)
    pos = torch.cat([b.position_ids, torch.arange(extra, dtype=b.position_ids.dtype)[None]], dim=1)
    cu = torch.cat([b.cu_seqlens, torch.tensor([length], dtype=b.cu_seqlens.dtype)])
    br = None if b.branch_ids is None else torch.cat([b.branch_ids, torch.zeros(extra, dtype=b.branch_ids.dtype)])
    return PackedBatch(ids, pos, cu, b.score_rows, b.score_targets, b.scored_per_seq, br, b.extras, b.pairs)


def greedy_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Greedy, order-preserving packing of sequences into micro-batches of at most ``max_tokens`` tokens
    (a longer sequence gets a micro-batch of its own)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    out, cur, used = [], [], 0
    for i, n in enumerate(lengths):
        if cur and used + n > max_tokens:
            out.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        out.append(cur)
    return out


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def forward_step(data_iterator, model, *, return_entropy: bool = False, loss_func=None, temperature: float = 1.0,
                 topk: int = 0):
    """megatron-core ``forward_step_func``: runs one :class:`PackedBatch` through ``model``.

    ``loss_func(batch, output)`` is bound to the batch; the default collects log-probs (forward only).
    ``temperature``: log-probs and entropy of softmax(logits / temperature). A batch with ``pairs`` makes the last
    stage return ``(scores, divergences)`` (``topk``: the top-k of the skill side too; see ``OpidGPTModel``)."""
    batch: PackedBatch = next(data_iterator)
    params = batch.packed_seq_params(_device())
    batch = batch.to(_device())
    out = model(batch.input_ids, batch.position_ids, None, packed_seq_params=params, score_rows=batch.score_rows,
                score_targets=batch.score_targets, return_entropy=return_entropy, temperature=temperature,
                pairs=batch.pairs, topk=topk)
    return out, partial(loss_func or logprob_loss_func, batch)


def split_output(output):
    """The last stage's output as (scores ``[1 or 2, n]``, divergence dict or None)."""
    return output if isinstance(output, tuple) else (output, None)


def logprob_loss_func(batch: PackedBatch, output):
    """Forward-only 'loss': returns zero and the per-sequence log-probs (and entropies) for collection; with row
    pairs also the batch's divergence outputs (``"divergence"``: one dict of float32 [P] / [P, k] CPU tensors)."""
    output, div = split_output(output)
    lp = output[0].detach().float().cpu().split(batch.scored_per_seq)
    data = {"logprobs": list(lp)}
    if output.shape[0] > 1:
        data["entropy"] = list(output[1].detach().float().cpu().split(batch.scored_per_seq))
    if div is not None:
        data["divergence"] = [{k: v.detach().cpu() if k == "topk_ids" else v.detach().float().cpu()
                               for k, v in div.items()}]
    zero = output.sum() * 0.0
    return zero, torch.tensor(0, dtype=torch.int), data


def run_schedule(chunks, batches: list[PackedBatch], forward_step_func, forward_only: bool):
    """Run the (pipeline) schedule over ``batches`` on the model chunks; returns the last stage's loss dicts."""
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if len(chunks) > 1 and len(batches) % pp:  # the interleaved schedule wants a multiple of pp micro-batches
        batches = list(batches) + [empty_batch() for _ in range(pp - len(batches) % pp)]
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp > 1 and chunks[0].config.sequence_parallel:  # sequence parallel splits every micro-batch over TP ranks
        batches = [pad_batch(b, -(-int(b.input_ids.shape[1]) // tp) * tp) for b in batches]
    seq = max(int(b.input_ids.shape[1]) for b in batches)
    if len(chunks) > 1:  # the interleaved schedule sends fixed-shape activations: pad with a dummy segment
        batches = [pad_batch(b, seq) for b in batches]
    data_iter = [iter(batches) for _ in chunks] if len(chunks) > 1 else iter(batches)
    return get_forward_backward_func()(
        forward_step_func=forward_step_func, data_iterator=data_iter,
        model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=len(batches),
        seq_length=seq, micro_batch_size=1, forward_only=forward_only,
    )


@torch.no_grad()
def compute_logprobs(chunks, samples: Sequence[Sample], max_tokens: int = 4096, return_entropy: bool = False,
                     batches: Optional[list[PackedBatch]] = None, temperature: float = 1.0, topk: int = 0):
    """Log-probs (and entropies) of ``tokens[score_from:]`` for each sample, on every rank of the model-parallel
    group (broadcast from the last pipeline stage). Returns a list of float32 tensors (or two lists).
    Pre-built ``batches`` (e.g. fork-layout batches) may be given instead of samples. ``temperature``: of
    softmax(logits / temperature), the sampling temperature of the rollout (1.0: the plain softmax).
    Batches with row ``pairs`` (all or none of them): the result is ``(log-probs, divergences)`` (or
    ``(log-probs, entropies, divergences)``), one divergence dict per batch (``topk``: of the skill side)."""
    for c in chunks:
        c.eval()
    if batches is None:
        plan = greedy_micro_batches([len(s.tokens) for s in samples], max_tokens)
        batches = [pack([samples[i] for i in mb]) for mb in plan] or [empty_batch()]
    with_pairs = {b.pairs is not None for b in batches}
    if len(with_pairs) > 1:
        raise ValueError("compute_logprobs: either every batch has row pairs or none has")
    n_real = len(batches)
    outs = run_schedule(chunks, batches, partial(forward_step, return_entropy=return_entropy, temperature=temperature,
                                                 topk=topk), forward_only=True)
    lps, ents, divs = [], [], []
    for d in outs:
        lps.extend(d["logprobs"])
        ents.extend(d.get("entropy", []))
        divs.extend(d.get("divergence", []))
    result = [lps, ents, divs[:n_real]]
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        group = parallel_state.get_pipeline_model_parallel_group()
        src = dist.get_process_group_ranks(group)[-1]
        dist.broadcast_object_list(result, src=src, group=group)
    head = (result[0], result[1]) if return_entropy else (result[0],)
    if True in with_pairs:
        return (*head, result[2])
    return head if return_entropy else head[0]
