"""Fused hidden-state -> token log-prob (and entropy), vocabulary-parallel, forward + backward.

    logprob[i] = log softmax(hidden[i] @ W_full^T / T)[targets[i]]
    entropy[i] = -sum_v p[i, v] log p[i, v]

without materialising the `[N, V]` logits. T is the sampling temperature (`temperature`, default 1: the division
is skipped, so T = 1 is bit-identical to the plain softmax): log-probs are those of the distribution the sampler
drew from (docs/algorithm.md "Reference rules in detail": logits / T), and the backward carries the 1/T factor.
The weight on this rank is a vocabulary shard
`W_full[vocab_start : vocab_start + V_local]`; `targets` holds GLOBAL vocabulary ids.

Each rank reduces its shard to per-row partials, all relative to the local running max `m`:

    m = max_v l_v,   s = sum_v exp(l_v - m),   u = sum_v exp(l_v - m) (l_v - m),   t = l_target (0 if not here)

and, with a `tp_group`, they are combined with one MAX all-reduce (m) and one SUM all-reduce of
(s, u, t, found) rescaled to the global max M (`merge_partials` is the same merge over a local dimension). Then
`logZ = M + log S`, `logprob = t - logZ`, `entropy = log S - U / S`. The backward works chunk by chunk from the
saved `logZ` (and entropy):

    d logprob / d l_v = 1[v = target] - p_v
    d entropy / d l_v = -p_v (l_v - logZ + entropy)

so it also never needs full logits nor any communication except the gradient of the (replicated) hidden states.

Backends (the vocabulary is cut into chunks of `chunk_size` columns in both):
  torch  -- per chunk an fp32 matmul and the statistics in torch ops (CPU production path; DEFAULT_CHUNK columns).
  triton -- per chunk one GEMM with half-precision inputs and an fp32 output (cuBLAS) and one autotuned Triton
            epilogue that reads the chunk once (logprob_triton.py, which says why); chunks of CHUNK_BYTES of fp32
            logits (`triton_chunk_columns`); the backward reuses the last chunks the forward computed
            (`saved_logits_bytes`) and recomputes the others.
`logprobs_reference` is the naive float64 full-logits version for tests.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from ._dispatch import load_triton_module, resolve_backend

DEFAULT_CHUNK = 4096      # torch backend: vocabulary columns per chunk
CHUNK_BYTES = 64 << 20    # Triton backend: fp32 logits per chunk (the GEMM output the epilogue reads)
CHUNK_ALIGN = 256         # Triton backend: chunk widths are multiples of this (whole epilogue tiles)


def triton_chunk_columns(rows: int, vocab: int) -> int:
    """Vocabulary columns per chunk of the Triton backend for `rows` rows: as many as CHUNK_BYTES of fp32 logits
    hold, a multiple of CHUNK_ALIGN (at least one), at most the shard. At Qwen2.5-7B's head with 4,096 rows: 4,096
    columns, a [4096, 3584] x [3584, 4096] GEMM (120 GFLOP) per chunk, 38 chunks."""
    cols = CHUNK_BYTES // (4 * max(1, rows))
    return max(1, min(vocab, max(CHUNK_ALIGN, cols // CHUNK_ALIGN * CHUNK_ALIGN)))


def merge_partials(m: torch.Tensor, s: torch.Tensor, u: torch.Tensor, t: torch.Tensor):
    """Merge per-row partials [k, N] (each relative to its own max m, an empty part has m = -inf and s = 0) over
    their first dimension: (M, S, U, T) [N], as the TP all-reduce of `combine_partials` merges the ranks' parts."""
    big_m = m.max(dim=0).values
    ref = torch.where(torch.isinf(big_m), torch.zeros_like(big_m), big_m)
    alpha = torch.exp(m - ref)  # 0 for an empty part
    d = torch.where(s > 0, m - ref, torch.zeros_like(m))
    return big_m, (s * alpha).sum(0), (alpha * (u + d * s)).sum(0), t.sum(0)


# ----------------------------------------------------------------------------------------------------------------
# naive float64 reference (tests only: materialises [N, V])
# ----------------------------------------------------------------------------------------------------------------
def logprobs_reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, vocab_start: int = 0,
                       return_entropy: bool = False, temperature: float = 1.0):
    """Full-logits float64 reference on ONE (unsharded or shard-only) weight. Targets must lie in the shard."""
    logits = hidden.double() @ weight.double().t()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(-1, (targets.long() - vocab_start).unsqueeze(-1)).squeeze(-1)
    if not return_entropy:
        return lp
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


# ----------------------------------------------------------------------------------------------------------------
# torch path
# ----------------------------------------------------------------------------------------------------------------
def _local_partials_torch(hidden: torch.Tensor, weight: torch.Tensor, targets_local: torch.Tensor,
                          with_entropy: bool, chunk: int, temperature: float = 1.0):
    """Per-row partials over this shard of the logits / temperature: (m, s, u, t, found), all float32 [N]."""
    n, v = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    h32 = hidden.float()
    m = torch.full((n,), float("-inf"), device=dev)
    s = torch.zeros(n, device=dev)
    u = torch.zeros(n, device=dev)
    t = torch.zeros(n, device=dev)
    found = (targets_local >= 0) & (targets_local < v)
    rows = torch.arange(n, device=dev)
    for start in range(0, v, chunk):
        end = min(start + chunk, v)
        logits = h32 @ weight[start:end].float().t()  # [N, C] float32
        if temperature != 1.0:
            logits.div_(temperature)
        sel = found & (targets_local >= start) & (targets_local < end)
        idx = (targets_local - start).clamp(0, end - start - 1)
        t = torch.where(sel, logits[rows, idx], t)
        new_m = torch.maximum(m, logits.max(dim=1).values)
        alpha = torch.exp(m - new_m)  # 0 on the first chunk (m = -inf)
        if with_entropy:
            # u is relative to the old max: re-base it on new_m (d = m - new_m; 0 where nothing was seen yet)
            d = torch.where(s > 0, m - new_m, torch.zeros_like(m))
            u = alpha * (u + d * s)
        s = s * alpha
        logits.sub_(new_m.unsqueeze(1))  # x = l - new_m  (two [N, chunk] buffers in all: x and exp(x))
        e = torch.exp(logits)
        s = s + e.sum(dim=1)
        if with_entropy:
            u = u + logits.mul_(e).sum(dim=1)
        m = new_m
        del logits, e
    return m, s, u, t, found


def combine_partials(m: torch.Tensor, s: torch.Tensor, u: torch.Tensor, t: torch.Tensor, found: torch.Tensor,
                     tp_group=None, check_targets: bool = True):
    """Reduce per-rank partials over `tp_group` (None: single shard). Returns (logprob, entropy, logZ) float32."""
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        big_m = m.clone()
        dist.all_reduce(big_m, op=dist.ReduceOp.MAX, group=tp_group)
        alpha = torch.exp(m - big_m)  # 0 on a rank whose shard is empty (m = -inf)
        d = torch.where(s > 0, m - big_m, torch.zeros_like(m))
        stacked = torch.stack([s * alpha, alpha * (u + d * s), t, found.float()])
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=tp_group)
        s, u, t, found_count = stacked[0], stacked[1], stacked[2], stacked[3]
        m = big_m
        bad = found_count.round() != 1
    else:
        bad = ~found
    if check_targets and bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"fused_logprobs: target id of row {i} is outside the vocabulary covered by the shard(s)")
    log_s = torch.log(s)
    log_z = m + log_s
    logprob = t - log_z
    entropy = log_s - u / s
    return logprob, entropy, log_z


def _grad_logits_chunk(logits: torch.Tensor, start: int, targets_local: torch.Tensor, log_z: torch.Tensor,
                       entropy: Optional[torch.Tensor], g_lp: Optional[torch.Tensor], g_ent: Optional[torch.Tensor]):
    """In place: logits chunk [N, C] (float32) -> d loss / d logits for that chunk."""
    c = logits.shape[1]
    x = logits.sub_(log_z.unsqueeze(1))  # log p  (two [N, chunk] buffers in all: x and p)
    p = torch.exp(x)
    if g_ent is not None:
        grad = x.add_(entropy.unsqueeze(1)).mul_(p).mul_(-g_ent.unsqueeze(1))  # -g_ent * p * (log p + H)
        if g_lp is not None:
            grad.addcmul_(p, g_lp.unsqueeze(1), value=-1.0)
    else:
        grad = p.mul_(-g_lp.unsqueeze(1))
    if g_lp is not None:
        sel = (targets_local >= start) & (targets_local < start + c)
        rows = sel.nonzero().squeeze(1)
        if rows.numel():
            grad[rows, targets_local[rows] - start] += g_lp[rows]
    return grad


def _backward_torch(hidden, weight, targets_local, log_z, entropy, g_lp, g_ent, chunk, need_h, need_w,
                    temperature: float = 1.0, main_grad=None):
    """(grad_hidden fp32, grad_weight): with ``main_grad`` (fp32 [V_local, H]) the weight gradient is ADDED to it
    in fp32 and grad_weight is None (see :func:`_fp32_main_grad`)."""
    n, v = hidden.shape[0], weight.shape[0]
    h32 = hidden.float()
    grad_h = torch.zeros(n, hidden.shape[1], device=hidden.device) if need_h else None
    grad_w = torch.empty_like(weight) if need_w and main_grad is None else None
    for start in range(0, v, chunk):
        end = min(start + chunk, v)
        w32 = weight[start:end].float()
        logits = h32 @ w32.t()
        if temperature != 1.0:
            logits.div_(temperature)
        grad = _grad_logits_chunk(logits, start, targets_local, log_z, entropy, g_lp, g_ent)
        if temperature != 1.0:  # d(l / T) / d l = 1 / T
            grad.div_(temperature)
        if need_h:
            grad_h.addmm_(grad, w32)
        if need_w and main_grad is not None:
            main_grad[start:end].addmm_(grad.t(), h32)
        elif need_w:
            if weight.dtype == torch.float32:
                torch.mm(grad.t(), h32, out=grad_w[start:end])
            else:
                grad_w[start:end] = (grad.t() @ h32).to(weight.dtype)
    return grad_h, grad_w


def _fp32_main_grad(weight: torch.Tensor, rows: int):
    """The fp32 gradient buffer to accumulate the weight gradient into, or None.

    megatron-core's DDP gives every parameter a ``main_grad`` (fp32 with ``grad_reduce_in_fp32``) and, after the
    backward, adds ``param.grad`` into it. A bf16/fp16 weight's gradient returned by autograd is rounded to the
    weight's dtype first (per micro-batch). As megatron's ``gradient_accumulation_fusion`` does for its linear
    layers, the head's weight gradient goes straight into ``main_grad`` in fp32 instead; autograd then gets a zero
    gradient (a zero, not megatron's uninitialised dummy, and ``grad_added_to_main_grad`` left alone: whatever
    else adds to the same parameter -- the tied input embedding, the divergence head -- still reaches main_grad
    through DDP's hook, exactly). ``rows``: the rows in use (vocabulary padding is left out)."""
    main = getattr(weight, "main_grad", None)
    if (main is None or weight.dtype == torch.float32 or main.dtype != torch.float32
            or main.shape != weight.shape or not weight.requires_grad):
        return None
    return main[:rows]


# ----------------------------------------------------------------------------------------------------------------
# autograd
# ----------------------------------------------------------------------------------------------------------------
class _FusedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_start, tp_group, with_entropy, backend, chunk, reduce_grad,
                temperature, main_grad, saved_bytes):
        targets_local = targets - vocab_start
        if weight.shape[0] == 0:  # this rank's shard is all vocabulary padding
            backend = "torch"
        ctx.kept = {}
        if backend == "triton":
            tri = load_triton_module("logprob_triton", hidden)
            keep = 0
            if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
                cols = chunk or triton_chunk_columns(hidden.shape[0], weight.shape[0])
                keep = tri.kept_chunks(tri.chunks_of(weight.shape[0], cols), hidden.shape[0], saved_bytes)
            m, s, u, t, found, ctx.kept = tri.local_partials(hidden, weight, targets_local, with_entropy, temperature,
                                                             chunk, keep)
        else:
            m, s, u, t, found = _local_partials_torch(hidden, weight, targets_local, with_entropy,
                                                      chunk or DEFAULT_CHUNK, temperature)
        logprob, entropy, log_z = combine_partials(m, s, u, t, found, tp_group)
        ctx.save_for_backward(hidden, weight, targets_local, log_z, entropy if with_entropy else None)
        ctx.tp_group, ctx.backend, ctx.chunk, ctx.reduce_grad = tp_group, backend, chunk, reduce_grad
        ctx.with_entropy, ctx.temperature, ctx.main_grad = with_entropy, temperature, main_grad
        ctx.set_materialize_grads(False)
        if with_entropy:
            return logprob, entropy
        no_entropy = torch.zeros_like(logprob)
        ctx.mark_non_differentiable(no_entropy)
        return logprob, no_entropy

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, targets_local, log_z, entropy = ctx.saved_tensors
        kept, ctx.kept = ctx.kept, {}
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not ctx.with_entropy:
            g_ent = None
        if (g_lp is None and g_ent is None) or not (need_h or need_w):
            return (None,) * 12
        g_lp = g_lp.float().contiguous() if g_lp is not None else None
        g_ent = g_ent.float().contiguous() if g_ent is not None else None
        main = ctx.main_grad if need_w else None
        if ctx.backend == "triton":
            tri = load_triton_module("logprob_triton", hidden)
            grad_h, grad_w = tri.backward(hidden, weight, targets_local, log_z, entropy, g_lp, g_ent, need_h, need_w,
                                          ctx.temperature, main_grad=main, chunk_size=ctx.chunk, kept=kept)
        else:
            grad_h, grad_w = _backward_torch(hidden, weight, targets_local, log_z, entropy, g_lp, g_ent,
                                             ctx.chunk or DEFAULT_CHUNK, need_h, need_w, ctx.temperature,
                                             main_grad=main)
        if main is not None:  # accumulated into main_grad in fp32: autograd's share is zero (see _fp32_main_grad)
            grad_w = torch.zeros_like(weight)
        if grad_h is not None:
            if ctx.reduce_grad and ctx.tp_group is not None and dist.get_world_size(ctx.tp_group) > 1:
                dist.all_reduce(grad_h, op=dist.ReduceOp.SUM, group=ctx.tp_group)
            grad_h = grad_h.to(hidden.dtype)
        return grad_h, grad_w, None, None, None, None, None, None, None, None, None, None


def fused_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, vocab_start: int = 0,
                   tp_group=None, return_entropy: bool = False, backend: str = "auto",
                   chunk_size: Optional[int] = None, reduce_hidden_grad: bool = True, vocab_size: Optional[int] = None,
                   temperature: float = 1.0, saved_logits_bytes: Optional[int] = None,
                   ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Log-probs of `targets` under softmax(hidden @ W^T), vocabulary-parallel, without [N, V] logits.

    Args:
        hidden: [N, H] (or [..., H]) final hidden states, fp32/bf16/fp16. Must be IDENTICAL on every rank of
            `tp_group` (replicated input of the vocab-parallel output layer).
        weight: [V_local, H] this rank's vocabulary shard of the output embedding, same dtype as hidden.
        targets: [N] (or [...]) int64 GLOBAL vocabulary ids; each must lie in exactly one rank's shard.
        vocab_start: first global id of this rank's shard ([vocab_start, vocab_start + V_local)).
        tp_group: process group over which the vocabulary is split (None: this shard is the whole vocabulary).
        return_entropy: also return the per-row entropy of the full softmax (differentiable too).
        backend: "auto" | "triton" | "torch" (see `_dispatch.py`).
        chunk_size: vocabulary columns per chunk (peak extra memory ~ 2 * N * chunk_size * 4 bytes). None: the
            backend's plan (torch: DEFAULT_CHUNK; Triton: `triton_chunk_columns`, CHUNK_BYTES of fp32 logits).
        reduce_hidden_grad: all-reduce (SUM) the hidden-state gradient over `tp_group` in backward, so every rank
            gets the full gradient of its replicated input. Set False when the caller already reduces it (e.g. the
            input came through Megatron's `copy_to_tensor_model_parallel_region` / sequence-parallel gather).
        vocab_size: number of REAL global vocabulary entries; weight rows with global id >= vocab_size (Megatron's
            vocabulary padding) are left out of the softmax and get zero gradient. None: every row is real.
        temperature: T > 0; the log-probs (and entropy) are those of softmax(logits / T), the distribution a sampler
            at temperature T draws from. 1.0 (default) skips the division: bit-identical to the plain softmax.
        saved_logits_bytes: Triton backend with gradients: how many bytes of the forward's fp32 logits chunks (the
            last ones) are kept for the backward instead of recomputed -- where memory allows, up to N * V_local * 4
            (no recompute at all). None: one chunk (the buffer the backward would allocate anyway); 0: none.

    A bf16/fp16 ``weight`` with an fp32 ``main_grad`` (megatron-core DDP) gets its gradient accumulated into
    ``main_grad`` in fp32 by the backward (autograd sees zero for it; :func:`_fp32_main_grad`).

    Returns float32 log-probs with targets' shape, or (logprobs, entropy). Differentiable w.r.t. hidden and weight.
    """
    if hidden.dim() < 2:
        raise ValueError(f"fused_logprobs: hidden must be [N, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"fused_logprobs: weight must be [V_local, H={hidden.shape[-1]}], got {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"fused_logprobs: targets shape {tuple(targets.shape)} != hidden leading shape "
                         f"{tuple(hidden.shape[:-1])}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"fused_logprobs: targets must be int64 vocabulary ids, got {targets.dtype}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"fused_logprobs: hidden dtype {hidden.dtype} != weight dtype {weight.dtype}")
    if hidden.device != weight.device or hidden.device != targets.device:
        raise ValueError("fused_logprobs: hidden, weight and targets must be on the same device")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"fused_logprobs: chunk_size must be >= 1, got {chunk_size}")
    temperature = float(temperature)
    if not (temperature > 0 and temperature < float("inf")):
        raise ValueError(f"fused_logprobs: temperature must be a finite number > 0, got {temperature}")
    lead = targets.shape
    h2 = hidden.reshape(-1, hidden.shape[-1])
    if not h2.is_contiguous():
        h2 = h2.contiguous()
    w = weight if weight.is_contiguous() else weight.contiguous()
    if vocab_size is not None:
        valid = min(weight.shape[0], max(0, int(vocab_size) - int(vocab_start)))
        if valid < weight.shape[0]:
            w = w[:valid]  # a view: autograd gives the padded rows a zero gradient
    tg = targets.reshape(-1).long()
    chosen = resolve_backend(backend, hidden, "fused_logprobs")
    lp, ent = _FusedLogprobs.apply(h2, w, tg, int(vocab_start), tp_group, bool(return_entropy), chosen,
                                   None if chunk_size is None else int(chunk_size), bool(reduce_hidden_grad),
                                   temperature, _fp32_main_grad(weight, w.shape[0]), saved_logits_bytes)
    if return_entropy:
        return lp.reshape(lead), ent.reshape(lead)
    return lp.reshape(lead)


def naive_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, vocab_start: int = 0,
                   return_entropy: bool = False, temperature: float = 1.0):
    """The usual un-fused path in the input precision (full [N, V] logits + log_softmax): the benchmark baseline."""
    logits = (hidden @ weight.t()).float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(-1, (targets.long() - vocab_start).unsqueeze(-1)).squeeze(-1)
    if return_entropy:
        return lp, -(logp.exp() * logp).sum(-1)
    return lp
