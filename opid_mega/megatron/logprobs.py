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

Sequences (:class:`Sample`, or flat token arrays) become micro-batches through :func:`plain_batches`: the C++ batch
builder's plain layout (``opid_mega.batching.build_train_batches``: token-budget packing, largest sequence first,
balanced over data-parallel ranks), with :meth:`PlainBatches.unpack` bringing scored values back into sample order.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from functools import partial
from typing import Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from opid_mega.batching.layout import csr_offsets, csr_ranges
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


def empty_batch() -> PackedBatch:
    """A one-token micro-batch that scores nothing (pads schedules that need a minimum micro-batch count)."""
    e = torch.zeros(0, dtype=torch.long)
    return PackedBatch(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long),
                       torch.tensor([0, 1], dtype=torch.int32), e, e, [],
                       extras={k: torch.zeros(0) for k in ("old_logprobs", "advantages", "ref_logprobs",
                                                            "loss_mask")})


# per scored token values a plain micro-batch can carry (PackedBatch.extras); loss_mask defaults to ones;
# loss_weight: optional per-token PPO loss weights (opid_mega.algo.reference_micro_weights)
VALUE_KEYS = ("old_logprobs", "advantages", "ref_logprobs", "loss_weight", "loss_mask")


@dataclass
class PlainBatches:
    """One rank's plain-layout micro-batches (:func:`plain_batches`) and where its samples' scored values land.

    ``batches``: this rank's micro-batches, in schedule order (an empty one is :func:`empty_batch`). ``samples``:
    int64, the indices (ascending) of the input samples this rank scores (all of them with one rank).
    ``resp_lens``: int64, their scored-token counts. ``gather_index``: int64 [sum resp_lens]: for each scored token
    of ``samples`` in sample order, its position among this rank's gathered values (the batches' scored rows
    concatenated in batch order: the order of ``score_rows`` and ``extras``, of the loss function's outputs)."""

    batches: list
    samples: np.ndarray
    resp_lens: np.ndarray
    gather_index: np.ndarray

    def unpack(self, gathered) -> list:
        """Gathered values back in sample order: one tensor per sample of ``samples`` (``resp_lens`` values each).

        ``gathered``: one flat tensor over this rank's batches (batch order), or a list of tensors that concatenate
        to it (one per batch, or ``logprob_loss_func``'s per-sequence pieces, padding batches included: they are
        empty)."""
        if isinstance(gathered, (list, tuple)):
            flat = torch.cat([torch.as_tensor(x).reshape(-1) for x in gathered]) if gathered else torch.zeros(0)
        else:
            flat = torch.as_tensor(gathered).reshape(-1)
        if flat.numel() != self.gather_index.size:
            raise ValueError(f"unpack: got {flat.numel()} gathered values, the batches score {self.gather_index.size}")
        idx = torch.from_numpy(self.gather_index).to(flat.device)
        return list(flat[idx].split(self.resp_lens.tolist()))

    def gathered(self, values: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`unpack`: per-token values of ``samples`` in sample order (flat, [..., sum
        resp_lens]) in this rank's gathered order (last dimension; differentiable)."""
        values = torch.as_tensor(values)
        if values.shape[-1] != self.gather_index.size:
            raise ValueError(f"gathered: got {values.shape[-1]} values, the samples score {self.gather_index.size}")
        perm = np.empty_like(self.gather_index)
        perm[self.gather_index] = np.arange(self.gather_index.size, dtype=np.int64)
        return values[..., torch.from_numpy(perm).to(values.device)]


def _sample_arrays(samples: Sequence[Sample]) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict]:
    """(tokens int32, seq_offsets int64, resp_lens int64, values) of Samples; a value key is there when every
    sample has it (loss_mask: ones where a sample has none), as float32 [sum resp_lens] in sample order."""
    lens = np.fromiter((len(s.tokens) for s in samples), np.int64, count=len(samples))
    tokens = np.fromiter(itertools.chain.from_iterable(s.tokens for s in samples), np.int64, count=int(lens.sum()))
    resp = np.fromiter((s.n_scored for s in samples), np.int64, count=len(samples))
    values = {}
    for k in VALUE_KEYS:
        vals = [getattr(s, k, None) for s in samples]  # a Sample carries no loss_weight
        for s, v in zip(samples, vals):
            if v is not None and len(v) != s.n_scored:
                raise ValueError(f"{k} has {len(v)} values, the sample scores {s.n_scored} tokens")
        if k == "loss_mask":
            vals = [np.ones(s.n_scored, np.float32) if v is None else v for s, v in zip(samples, vals)]
        elif any(v is None for v in vals):
            continue
        values[k] = np.fromiter(itertools.chain.from_iterable(vals), np.float32, count=int(resp.sum()))
    return _int32_tokens(tokens), csr_offsets(lens), resp, values


def _int32_tokens(tokens: np.ndarray) -> np.ndarray:
    if tokens.dtype != np.int32 and tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(np.int32).max):
        raise ValueError("token ids must lie in [0, 2^31)")
    return np.ascontiguousarray(tokens, np.int32)


def plain_batches(samples, budget: int, num_ranks: int = 1, rank: int = 0, values: Optional[dict] = None,
                  backend: Optional[str] = None) -> PlainBatches:
    """Sequences packed into plain-layout micro-batches of at most ``budget`` tokens by the batch builder
    (``opid_mega.batching.build_train_batches``: largest first onto the least-loaded micro-batch, balanced over
    ``num_ranks`` data-parallel ranks, the same number of micro-batches on every rank); ``rank``'s share as a
    :class:`PlainBatches`. A sequence longer than ``budget`` raises the budget to the longest sequence (as
    ``TrainData.micro_batches`` does): micro-batches hold at most max(budget, longest sequence) tokens, and the
    longest sequence, when over the budget, fills one alone.

    ``samples``: a sequence of :class:`Sample`, or the arrays ``(tokens, seq_offsets, resp_lens)`` (int tokens of
    every sequence concatenated, [S+1] offsets, [S] scored tokens: the last ``resp_lens[s]`` of sequence s, at least
    one token before them). ``values``: per scored token values for ``PackedBatch.extras`` keyed by
    ``VALUE_KEYS``, float32 [sum resp_lens] in sample order; None: for Samples their fields (a key is there when
    every sample has it), for arrays none. ``loss_mask`` is ones unless given. ``backend``: the builder's
    (None: ``opid_mega._C`` when built)."""
    from opid_mega.batching import build_train_batches

    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank {rank} is not in [0, {num_ranks})")
    if int(budget) < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    if isinstance(samples, tuple) and len(samples) == 3 and not isinstance(samples[0], Sample):
        tokens, seq_offsets, resp_lens = (np.asarray(x.numpy() if torch.is_tensor(x) else x) for x in samples)
        tokens = _int32_tokens(tokens)
        seq_offsets, resp_lens = (np.ascontiguousarray(x, np.int64) for x in (seq_offsets, resp_lens))
        given = {}
    else:
        tokens, seq_offsets, resp_lens, given = _sample_arrays(samples)
    if values is not None:
        given = {}
        for k, v in values.items():
            if k not in VALUE_KEYS:
                raise ValueError(f"unknown value {k!r}; allowed: {', '.join(VALUE_KEYS)}")
            if v is not None:
                given[k] = np.ascontiguousarray(v.numpy() if torch.is_tensor(v) else v, np.float32)
    total = int(resp_lens.sum())
    for k, v in given.items():
        if v.shape != (total,):
            raise ValueError(f"{k} has shape {v.shape}, expected ({total},) (one value per scored token)")
    given.setdefault("loss_mask", np.ones(total, np.float32))
    n = int(resp_lens.size)
    if n == 0:
        return PlainBatches([empty_batch()], np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
    budget = max(int(budget), int(np.diff(seq_offsets).max()))
    pb = build_train_batches(tokens, seq_offsets, resp_lens, budget, num_ranks, backend=backend)
    f = pb.flat
    per_rank = pb.micro_batches_per_rank
    start = f["ctx_gather_start"]
    # every scored token's place among all gathered rows (sample s's tokens start at ctx_gather_start[s])
    pos = csr_ranges(start, resp_lens)
    gathered = {}
    for k, v in given.items():
        g = np.empty_like(v)
        g[pos] = v
        gathered[k] = torch.from_numpy(g)
    out = rank_batches(pb, rank, gathered, resp_lens)
    per_rank = pb.micro_batches_per_rank
    mine = np.flatnonzero(f["ctx_micro_batch"] // per_rank == rank)
    base = int(f["mb_gather_offsets"][rank * per_rank])
    return PlainBatches(out, mine, resp_lens[mine], csr_ranges(start[mine] - base, resp_lens[mine]))


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
    group (broadcast from the last pipeline stage). Returns a list of float32 tensors (or two lists) in the samples'
    order; the samples are packed by :func:`plain_batches` into micro-batches of at most ``max_tokens`` tokens.
    Pre-built ``batches`` (e.g. fork-layout batches) may be given instead of samples. ``temperature``: of
    softmax(logits / temperature), the sampling temperature of the rollout (1.0: the plain softmax).
    Batches with row ``pairs`` (all or none of them): the result is ``(log-probs, divergences)`` (or
    ``(log-probs, entropies, divergences)``), one divergence dict per batch (``topk``: of the skill side)."""
    for c in chunks:
        c.eval()
    plain = None
    if batches is None:
        plain = plain_batches(samples, max_tokens)
        batches = plain.batches
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
    if plain is not None:  # the builder reorders samples (largest first): back into sample order
        result[0] = plain.unpack(result[0])
        result[1] = plain.unpack(result[1]) if return_entropy else []
    head = (result[0], result[1]) if return_entropy else (result[0],)
    if True in with_pairs:
        return (*head, result[2])
    return head if return_entropy else head[0]


def rank_batches(pb, rank: int, gathered: dict, ctx_resp_lens: np.ndarray, per_mb_pairs=None) -> list[PackedBatch]:
    """``rank``'s micro-batches of the builder output ``pb`` (``opid_mega.batching.PackedBatches``) as PackedBatches:
    the gathered per-token values (float32 tensors over every micro-batch's gathered rows, rank-major) sliced per
    micro-batch, each context's scored count in gathered order (``scored_per_seq``), and the row pairs of
    micro-batch k (``per_mb_pairs[k]``, from ``PackedBatches.pair_positions``) when given. An empty micro-batch is
    :func:`empty_batch`."""
    f = pb.flat
    order = np.lexsort((f["ctx_gather_start"], f["ctx_micro_batch"]))  # contexts by micro-batch, then gathered rows
    per_mb = csr_offsets(np.bincount(f["ctx_micro_batch"], minlength=pb.num_ranks * pb.micro_batches_per_rank))
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
