"""Batch builder: fork-layout scoring micro-batches, plain training micro-batches, token advantages.

Uses the C++ extension `opid_mega._C` when it is importable, else the numpy reference
(`opid_mega.batching.reference`, byte-identical outputs) and says so once per process. Every function takes
`backend=None|"cpp"|"python"` to force one.

Typical use (one training iteration):

    ctx = flatten_contexts([[(orig_ids, R), (skill_ids, R)] for each step-sample])   # or build the CSR arrays
    scoring = build_fork_batches(ctx, budget=16384, num_ranks=dp)                       # PackedBatches
    for mb in scoring.micro_batches(rank): ...forward...; logp_mb = logprobs[mb.gather_rows]
    per_ctx = scoring.unpack_logprobs([logp_mb for every micro-batch])                  # [sample][context]
    a_out = outcome_advantage(scores, group_ids, "mean_std_norm")
    adv = token_advantages(a_out, resp_lens, [d_ep, d_step], [use_ep, use_step], [lam_ep, lam_step])
    train = build_train_batches(prompt_resp_tokens, seq_offsets, resp_lens, budget, dp, token_values=adv)

Arrays are numpy (torch CPU tensors are accepted and viewed with `.numpy()`, no copy). Flat outputs of the
builders (keys of `PackedBatches.flat`), K = num_ranks * micro_batches_per_rank micro-batches, rank-major:
- tokens int32 [N], position_ids int32 [N], branch_ids int32 [N] (fork layout only), loss_mask bool [N] (plain
  layout only: True on rows that predict a response token); micro-batch k owns [mb_token_offsets[k],
  mb_token_offsets[k+1]).
- cu_seqlens int32, per micro-batch [groups+1] (local), sliced by mb_cu_offsets.
- gather_rows int32 [M] (row indices local to the micro-batch; row r predicts the next token of its branch),
  gather_targets int32 [M], gather_values float32 [M] (the given token values, e.g. advantages), sliced by
  mb_gather_offsets (`MicroBatch.dense_values()` scatters them to the rows: plain layout).
- ctx_gather_start int64 [C]: where context c's resp_len gathered values start in the concatenation of all
  micro-batches' M; ctx_micro_batch int64 [C].
- groups: group_sample_offsets/group_samples (CSR, samples of each group), group_prefix_lens, group_tokens,
  group_micro_batch; mb_group_offsets/mb_group_ids (groups of each micro-batch, ascending); sample_prefix_lens.
"""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np

from opid_mega.batching import reference
from opid_mega.batching.layout import ContextBatch, csr_ranges, flatten_contexts, shared_fraction

logger = logging.getLogger(__name__)

try:
    from opid_mega import _C  # type: ignore[attr-defined]
    _IMPORT_ERROR: Optional[BaseException] = None
except ImportError as exc:  # pragma: no cover - depends on the build
    _C = None
    _IMPORT_ERROR = exc

_WARNED = False

__all__ = [
    "ContextBatch",
    "MicroBatch",
    "PackedBatches",
    "backend_name",
    "build_fork_batches",
    "build_train_batches",
    "flatten_contexts",
    "outcome_advantage",
    "plan_micro_batches",
    "token_advantages",
]


def backend_name() -> str:
    """"cpp" when the extension is importable, else "python"."""
    return "cpp" if _C is not None else "python"


def _impl(backend: Optional[str]):
    global _WARNED
    if backend is None:
        if _C is not None:
            return _C
        if not _WARNED:
            _WARNED = True
            warnings.warn(f"opid_mega._C is not available ({_IMPORT_ERROR}); using the slower numpy batch builder",
                          RuntimeWarning, stacklevel=3)
        return reference
    if backend == "cpp":
        if _C is None:
            raise ImportError(f"opid_mega._C is not available: {_IMPORT_ERROR}")
        return _C
    if backend == "python":
        return reference
    raise ValueError(f"backend={backend!r}, allowed: None, 'cpp', 'python'")


def _np(x):
    """numpy view of a torch CPU tensor (no copy); anything else passes through unchanged (checked downstream)."""
    if type(x).__module__.startswith("torch") and hasattr(x, "numpy"):
        if x.device.type != "cpu":
            raise ValueError("batch builder inputs must live on the CPU")
        return x.detach().numpy()
    return x


@dataclass
class MicroBatch:
    """One packed micro-batch (views into the flat outputs)."""

    rank: int
    index: int
    tokens: np.ndarray
    position_ids: np.ndarray
    branch_ids: Optional[np.ndarray]  # None in the plain layout (no branches)
    cu_seqlens: np.ndarray
    loss_mask: Optional[np.ndarray]
    gather_rows: np.ndarray
    gather_targets: np.ndarray
    gather_values: Optional[np.ndarray]
    group_ids: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.size)

    def dense_values(self) -> np.ndarray:
        """`gather_values` scattered to their rows: float32 [num_tokens], 0 on rows that predict no response token
        (a Megatron-style per-token advantage beside `loss_mask`; on a GPU, scatter after the copy instead: M
        values travel instead of N). Plain layout only (in the fork layout several branches share a row)."""
        if self.gather_values is None or self.loss_mask is None:
            raise ValueError("dense_values needs a plain (training) micro-batch built with token_values")
        out = np.zeros(self.num_tokens, np.float32)
        out[self.gather_rows] = self.gather_values
        return out


@dataclass
class PackedBatches:
    """All micro-batches of one batch (rank-major), plus what is needed to unpack gathered values."""

    flat: Dict[str, np.ndarray]
    resp_lens: np.ndarray
    sample_offsets: np.ndarray
    num_naive_tokens: int

    @property
    def num_ranks(self) -> int:
        return int(self.flat["num_ranks"])

    @property
    def micro_batches_per_rank(self) -> int:
        return int(self.flat["micro_batches_per_rank"])

    @property
    def num_tokens(self) -> int:
        return int(self.flat["tokens"].size)

    @property
    def shared_fraction(self) -> float:
        """Fraction of the naive tokens (each context alone) that this layout saves."""
        return shared_fraction(self.num_naive_tokens, self.num_tokens)

    def micro_batch(self, rank: int, index: int) -> MicroBatch:
        if not (0 <= rank < self.num_ranks and 0 <= index < self.micro_batches_per_rank):
            raise IndexError(f"micro-batch ({rank}, {index}) out of range ({self.num_ranks} ranks x "
                             f"{self.micro_batches_per_rank})")
        f = self.flat
        k = rank * self.micro_batches_per_rank + index
        t0, t1 = f["mb_token_offsets"][k], f["mb_token_offsets"][k + 1]
        m0, m1 = f["mb_gather_offsets"][k], f["mb_gather_offsets"][k + 1]
        c0, c1 = f["mb_cu_offsets"][k], f["mb_cu_offsets"][k + 1]
        g0, g1 = f["mb_group_offsets"][k], f["mb_group_offsets"][k + 1]
        gv = f.get("gather_values")
        return MicroBatch(
            rank=rank, index=index, tokens=f["tokens"][t0:t1], position_ids=f["position_ids"][t0:t1],
            branch_ids=f["branch_ids"][t0:t1] if "branch_ids" in f else None, cu_seqlens=f["cu_seqlens"][c0:c1],
            loss_mask=f["loss_mask"][t0:t1] if "loss_mask" in f else None,
            gather_rows=f["gather_rows"][m0:m1], gather_targets=f["gather_targets"][m0:m1],
            gather_values=None if gv is None else gv[m0:m1], group_ids=f["mb_group_ids"][g0:g1])

    def micro_batches(self, rank: int) -> List[MicroBatch]:
        return [self.micro_batch(rank, j) for j in range(self.micro_batches_per_rank)]

    def pair_positions(self, pairs) -> tuple[List[tuple[np.ndarray, np.ndarray]], np.ndarray]:
        """Gathered positions of context pairs that score the same response (a skill context and its sample's
        original context), micro-batch by micro-batch.

        `pairs` int [P, 2]: (context a, context b) global context indices with equal resp_lens, both in one
        micro-batch (contexts of one sample always are). Returns (per micro-batch k, rank-major: int64 arrays
        (a_pos, b_pos) of positions local to k's gathered values, the pairs in k concatenated in pair order; and
        `starts` int64 [P]: where pair p's values start among the pair values of its micro-batch
        (`ctx_micro_batch[a]`))."""
        pairs = np.asarray(pairs, np.int64).reshape(-1, 2)
        f = self.flat
        n_ctx = f["ctx_gather_start"].size
        if pairs.size and (pairs.min() < 0 or pairs.max() >= n_ctx):
            raise ValueError(f"pair_positions: context indices must lie in [0, {n_ctx})")
        a, b = pairs[:, 0], pairs[:, 1]
        lens = self.resp_lens[a]
        bad = np.flatnonzero(lens != self.resp_lens[b])
        if bad.size:
            p = int(bad[0])
            raise ValueError(f"pair_positions: pair {p} ({int(a[p])}, {int(b[p])}) has responses of "
                             f"{int(lens[p])} and {int(self.resp_lens[b[p]])} tokens")
        mb = f["ctx_micro_batch"][a]
        bad = np.flatnonzero(mb != f["ctx_micro_batch"][b])
        if bad.size:
            raise ValueError(f"pair_positions: pair {int(bad[0])} spans two micro-batches")
        k_total = self.num_ranks * self.micro_batches_per_rank
        out, starts = [], np.zeros(len(pairs), np.int64)
        for k in range(k_total):
            sel = np.flatnonzero(mb == k)
            off = int(f["mb_gather_offsets"][k])
            rl = lens[sel]
            starts[sel] = np.cumsum(rl) - rl
            ranges = lambda ctx: (np.repeat(f["ctx_gather_start"][ctx] - off - (np.cumsum(rl) - rl), rl)  # noqa
                                  + np.arange(int(rl.sum()), dtype=np.int64))
            out.append((ranges(a[sel]), ranges(b[sel])))
        return out, starts

    def context_values(self, gathered) -> np.ndarray:
        """Gathered values -> one flat array, context-major: context c's resp_len values at
        csr_offsets(resp_lens)[c] (the columns a record keeps). `gathered` as for `unpack_logprobs`."""
        flat = self._gathered(gathered)
        return flat[csr_ranges(self.flat["ctx_gather_start"], self.resp_lens)]

    def unpack_logprobs(self, gathered) -> List[List[np.ndarray]]:
        """Gathered values -> `out[sample][context]` (resp_len values each).

        `gathered`: one flat array over all micro-batches (rank-major, concatenated), or a list with one array per
        micro-batch in rank-major order (torch tensors are accepted).
        """
        from opid_mega.batching.layout import unpack_logprobs
        return unpack_logprobs(self._gathered(gathered), self.flat["ctx_gather_start"], self.resp_lens,
                               self.sample_offsets)

    def _gathered(self, gathered) -> np.ndarray:
        if isinstance(gathered, (list, tuple)):
            parts = [np.asarray(_np(x)) for x in gathered]
            if len(parts) != self.num_ranks * self.micro_batches_per_rank:
                raise ValueError(f"unpack_logprobs: got {len(parts)} micro-batch arrays, expected "
                                 f"{self.num_ranks * self.micro_batches_per_rank}")
            offs = self.flat["mb_gather_offsets"]
            for k, p in enumerate(parts):
                if p.shape != (offs[k + 1] - offs[k],):
                    raise ValueError(f"unpack_logprobs: micro-batch {k} has shape {p.shape}, expected "
                                     f"({offs[k + 1] - offs[k]},)")
            flat = np.concatenate(parts) if parts else np.zeros(0)
        else:
            flat = np.asarray(_np(gathered))
            if flat.shape != (self.flat["gather_rows"].size,):
                raise ValueError(f"unpack_logprobs: shape {flat.shape}, expected ({self.flat['gather_rows'].size},)")
        return flat


def build_fork_batches(contexts: ContextBatch, budget: int, num_ranks: int = 1, *, share_prompts: bool = True,
                       max_group_tokens: Optional[int] = None, min_micro_batches: int = 1,
                       backend: Optional[str] = None) -> PackedBatches:
    """Scoring micro-batches in the fork layout (opid_mega.batching.layout), balanced over `num_ranks` DP ranks.

    Groups (one shared prefix + branches) never split; a sample larger than `budget` (or `max_group_tokens`)
    raises ValueError naming it.
    """
    c = ContextBatch(*(_np(x) for x in (contexts.tokens, contexts.ctx_offsets, contexts.resp_lens,
                                         contexts.sample_offsets)))
    flat = _impl(backend).build_batches(c.tokens, c.ctx_offsets, c.resp_lens, c.sample_offsets, budget, num_ranks,
                                        plain=False, share_prompts=share_prompts, max_group_tokens=max_group_tokens,
                                        min_micro_batches=min_micro_batches, token_values=None)
    return PackedBatches(dict(flat), c.resp_lens, c.sample_offsets, int(c.tokens.size))


def build_train_batches(tokens, seq_offsets, resp_lens, budget: int, num_ranks: int = 1, *, token_values=None,
                        min_micro_batches: int = 1, backend: Optional[str] = None) -> PackedBatches:
    """Plain training micro-batches: one sequence (prompt + response) per sample, branch ids 0.

    `token_values` float32 [sum resp_lens] (e.g. `token_advantages(...)`) comes back aligned to the gather rows
    (`gather_values`, M values; `MicroBatch.dense_values()` scatters them to the N rows beside `loss_mask`).
    """
    tokens, seq_offsets, resp_lens = _np(tokens), _np(seq_offsets), _np(resp_lens)
    token_values = None if token_values is None else _np(token_values)
    n = len(seq_offsets) - 1 if hasattr(seq_offsets, "__len__") else 0
    sample_offsets = np.arange(max(n, 0) + 1, dtype=np.int64)
    flat = _impl(backend).build_batches(tokens, seq_offsets, resp_lens, sample_offsets, budget, num_ranks,
                                        plain=True, share_prompts=False, max_group_tokens=None,
                                        min_micro_batches=min_micro_batches, token_values=token_values)
    return PackedBatches(dict(flat), resp_lens, sample_offsets, int(len(tokens)))


def plan_micro_batches(group_tokens, budget: int, num_ranks: int = 1, min_micro_batches: int = 1, *,
                       backend: Optional[str] = None):
    """(micro_batch_of_group int64 [G] rank-major, micro_batches_per_rank); see reference.plan_micro_batches."""
    return _impl(backend).plan_micro_batches(_np(group_tokens), budget, num_ranks, min_micro_batches)


def outcome_advantage(scores, group_ids, mode: str = "mean_std_norm", eps: float = 1e-6, *,
                      backend: Optional[str] = None) -> np.ndarray:
    """GRPO outcome advantage (float64 [S]); same semantics as opid_mega.algo.outcome_advantage."""
    return _impl(backend).outcome_advantage(_np(scores), _np(group_ids), mode, eps)


def token_advantages(outcome_adv, resp_lens, deltas: Sequence, masks: Sequence, lambdas: Sequence[float],
                     normalize: bool = False, clip: Optional[float] = None, *, eps: float = 1e-6,
                     groups=None, share_cap: Optional[float] = None, backend: Optional[str] = None) -> np.ndarray:
    """float32 [sum resp_lens]: A_out + Σ λ_k Δ'_k per response token (normalize: (Δ − μ)/(σ + eps); share_cap with
    groups: each group's skill term at most share_cap x its outcome term); see reference.token_advantages."""
    return _impl(backend).token_advantages(_np(outcome_adv), _np(resp_lens), [_np(d) for d in deltas],
                                           [_np(m) for m in masks], list(lambdas), normalize, clip, eps,
                                           None if groups is None else _np(groups), share_cap)
