"""Triton half of `logprob.py` (imported lazily; set TRITON_INTERPRET=1 before importing it to run on CPU).

Forward (`local_partials`): one fused kernel = matmul + online softmax. Program (i, j) takes BLOCK_N rows and the
j-th vocabulary split of this shard, loops over its vocabulary tiles (BLOCK_V) computing the logits tile with
`tl.dot` over hidden tiles (BLOCK_H, fp32 accumulation), and keeps running (max, sum-exp, sum-exp*logit, target
logit) per row. Logits never leave registers. Splitting the vocabulary (flash-decoding style) keeps the GPU busy
when N is small; the per-split partials ([splits, N] each) are merged in torch.

Backward (`backward`): per vocabulary chunk, a Triton kernel recomputes the logits tile and writes
d loss / d logits for the chunk ([N, chunk] in the input dtype); two cuBLAS matmuls turn it into
grad_hidden (accumulated in fp32) and the chunk's grad_weight rows -- for a bf16/fp16 weight with an fp32
``main_grad`` (megatron DDP) computed with fp32 output and added to main_grad (megatron's gradient accumulation
fusion), the tile then written as two half-precision parts (hi + lo, ~16 mantissa bits) and multiplied twice, so
the weight gradient is as accurate as an fp32 tile would make it (one more cuBLAS matmul per chunk).

Temperature T: with SCALED (constexpr, T != 1) every logits tile is divided by T in fp32 right after the matmul, and
the backward's d loss / d logits tile is divided by T (chain rule of l / T); T = 1 compiles without either op.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

# tile sizes; tests shrink them (module attributes) to exercise multi-tile paths at small shapes
BLOCK_N = 64
BLOCK_V = 128
BLOCK_H = 64
NUM_WARPS = 8
BWD_CHUNK = 8192          # vocabulary columns per backward chunk
TARGET_PROGRAMS = 1024    # forward grid size to aim for when choosing the vocabulary split
NUM_SPLITS = None         # force a number of vocabulary splits (tests); None = automatic


@triton.jit
def _logits_tile(h_ptr, w_ptr, rows, cols, row_mask, col_mask, HD, stride_h, stride_w,
                 BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr,
                 UPCAST: tl.constexpr):
    acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    for k0 in range(0, HD, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)
        k_mask = ks < HD
        h = tl.load(h_ptr + rows[:, None] * stride_h + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptr + cols[None, :] * stride_w + ks[:, None], mask=col_mask[None, :] & k_mask[:, None], other=0.0)
        if UPCAST:  # the CPU interpreter's dot mis-reads bf16 (raw uint16): multiply exact fp32 copies instead
            h = h.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(h, w, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _fwd_partials_kernel(h_ptr, w_ptr, tgt_ptr, m_ptr, s_ptr, u_ptr, t_ptr,
                         N, V, HD, stride_h, stride_w, v_per_split, temperature,
                         WITH_ENT: tl.constexpr, SCALED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                         BLOCK_H: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    tgt = tl.load(tgt_ptr + rows, mask=row_mask, other=-1)
    m = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    s = tl.zeros([BLOCK_N], dtype=tl.float32)
    u = tl.zeros([BLOCK_N], dtype=tl.float32)
    t = tl.zeros([BLOCK_N], dtype=tl.float32)
    v_begin = pid_s * v_per_split
    v_end = tl.minimum(v_begin + v_per_split, V)
    for v0 in range(v_begin, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_mask = cols < v_end
        logits = _logits_tile(h_ptr, w_ptr, rows, cols, row_mask, col_mask, HD, stride_h, stride_w,
                              BLOCK_N, BLOCK_V, BLOCK_H, PRECISION, UPCAST)
        if SCALED:
            logits = logits / temperature
        logits = tl.where(col_mask[None, :], logits, float("-inf"))
        hit = (cols[None, :] == tgt[:, None]) & col_mask[None, :]
        t += tl.sum(tl.where(hit, logits, 0.0), axis=1)
        new_m = tl.maximum(m, tl.max(logits, axis=1))
        alpha = tl.exp(m - new_m)
        x = tl.where(col_mask[None, :], logits - new_m[:, None], 0.0)
        e = tl.where(col_mask[None, :], tl.exp(x), 0.0)
        if WITH_ENT:
            d = tl.where(s > 0, m - new_m, 0.0)
            u = alpha * (u + d * s) + tl.sum(e * x, axis=1)
        s = s * alpha + tl.sum(e, axis=1)
        m = new_m
    out = pid_s * N + rows
    tl.store(m_ptr + out, m, mask=row_mask)
    tl.store(s_ptr + out, s, mask=row_mask)
    tl.store(t_ptr + out, t, mask=row_mask)
    if WITH_ENT:
        tl.store(u_ptr + out, u, mask=row_mask)


@triton.jit
def _bwd_grad_logits_kernel(h_ptr, w_ptr, tgt_ptr, logz_ptr, ent_ptr, glp_ptr, gent_ptr, g_ptr, glo_ptr,
                            N, C, HD, stride_h, stride_w, stride_g, c0, temperature,
                            HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr, SCALED: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr,
                            UPCAST: tl.constexpr, SPLIT: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    lcols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)  # column inside the chunk
    col_mask = lcols < C
    cols = c0 + lcols                                 # row of the local weight shard
    logits = _logits_tile(h_ptr, w_ptr, rows, cols, row_mask, col_mask, HD, stride_h, stride_w,
                          BLOCK_N, BLOCK_V, BLOCK_H, PRECISION, UPCAST)
    if SCALED:
        logits = logits / temperature
    logz = tl.load(logz_ptr + rows, mask=row_mask, other=0.0)
    logp = logits - logz[:, None]
    p = tl.exp(logp)
    grad = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    if HAS_GENT:
        ent = tl.load(ent_ptr + rows, mask=row_mask, other=0.0)
        gent = tl.load(gent_ptr + rows, mask=row_mask, other=0.0)
        grad = -gent[:, None] * p * (logp + ent[:, None])
    if HAS_GLP:
        tgt = tl.load(tgt_ptr + rows, mask=row_mask, other=-1)
        glp = tl.load(glp_ptr + rows, mask=row_mask, other=0.0)
        onehot = (cols[None, :] == tgt[:, None]).to(tl.float32)
        grad += glp[:, None] * (onehot - p)
    if SCALED:
        grad = grad / temperature
    hi = grad.to(g_ptr.dtype.element_ty)
    tl.store(g_ptr + rows[:, None] * stride_g + lcols[None, :], hi, mask=row_mask[:, None] & col_mask[None, :])
    if SPLIT:  # the rounding error of the half-precision tile, itself in half precision: hi + lo = grad to ~2^-16
        tl.store(glo_ptr + rows[:, None] * stride_g + lcols[None, :], (grad - hi.to(tl.float32)).to(
            glo_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs: exact fp32 products (no TF32) so log-probs match the torch path to fp32 rounding
    return "ieee" if dtype == torch.float32 or _upcast(dtype) else "tf32"


def _upcast(dtype: torch.dtype) -> bool:
    return INTERPRETED and dtype == torch.bfloat16


def _check(hidden: torch.Tensor, weight: torch.Tensor):
    if hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"fused_logprobs[triton]: unsupported dtype {hidden.dtype}")
    if hidden.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("fused_logprobs[triton]: hidden and weight need a contiguous last dimension")


def local_partials(hidden: torch.Tensor, weight: torch.Tensor, targets_local: torch.Tensor, with_entropy: bool,
                   temperature: float = 1.0):
    """Per-row partials (m, s, u, t, found) over this shard of logits / temperature, as in
    logprob._local_partials_torch."""
    _check(hidden, weight)
    n, hd = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    n_blocks = triton.cdiv(n, BLOCK_N)
    v_tiles = triton.cdiv(v, BLOCK_V)
    if NUM_SPLITS is not None:
        splits = max(1, min(int(NUM_SPLITS), v_tiles))
    else:
        splits = max(1, min(v_tiles, triton.cdiv(TARGET_PROGRAMS, n_blocks)))
    v_per_split = triton.cdiv(v_tiles, splits) * BLOCK_V
    splits = triton.cdiv(v, v_per_split)  # every split non-empty
    tg = targets_local.contiguous()
    m = torch.empty(splits, n, device=dev, dtype=torch.float32)
    s = torch.empty_like(m)
    t = torch.empty_like(m)
    u = torch.empty_like(m) if with_entropy else torch.zeros(1, device=dev, dtype=torch.float32)
    if n > 0:
        _fwd_partials_kernel[(n_blocks, splits)](
            hidden, weight, tg, m, s, u, t, n, v, hd, hidden.stride(0), weight.stride(0), v_per_split,
            float(temperature), WITH_ENT=with_entropy, SCALED=float(temperature) != 1.0, BLOCK_N=BLOCK_N,
            BLOCK_V=BLOCK_V, BLOCK_H=BLOCK_H,
            PRECISION=_precision(hidden.dtype), UPCAST=_upcast(hidden.dtype), num_warps=NUM_WARPS)
    big_m = m.max(dim=0).values
    alpha = torch.exp(m - big_m)
    s_tot = (s * alpha).sum(0)
    if with_entropy:
        u_tot = (alpha * (u + (m - big_m) * s)).sum(0)
    else:
        u_tot = torch.zeros_like(s_tot)
    found = (targets_local >= 0) & (targets_local < v)
    return big_m, s_tot, u_tot, t.sum(0), found


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b accumulated AND returned in fp32 (what megatron's wgrad_gemm_accum_fp32 computes): cuBLAS with
    half-precision inputs and an fp32 output where torch has it (``out_dtype``, CUDA), else on fp32 copies."""
    if a.dtype == torch.float32:
        return a @ b
    if a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):  # a torch without mm(out_dtype=) for these dtypes
            pass
    return a.float() @ b.float()


def backward(hidden, weight, targets_local, log_z, entropy, g_lp, g_ent, need_h, need_w, temperature: float = 1.0,
             main_grad=None):
    """(grad_hidden fp32, grad_weight). With ``main_grad`` (fp32 [V_local, H], logprob._fp32_main_grad) each chunk's
    weight gradient is computed with fp32 accumulation and output and ADDED to it; grad_weight is then None."""
    _check(hidden, weight)
    n, hd = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    grad_h = torch.zeros(n, hd, device=dev, dtype=torch.float32) if need_h else None
    grad_w = torch.empty_like(weight) if need_w and main_grad is None else None
    if n == 0:
        if grad_w is not None:
            grad_w.zero_()
        return grad_h, grad_w
    chunk = min(v, BWD_CHUNK)
    g = torch.empty(n, chunk, device=dev, dtype=hidden.dtype)
    split = main_grad is not None and need_w and hidden.dtype != torch.float32
    g_lo = torch.empty_like(g) if split else g
    dummy = log_z  # any float32 tensor for unused pointers
    tg = targets_local.contiguous()
    for c0 in range(0, v, chunk):
        c = min(chunk, v - c0)
        gc, glc = g[:, :c], g_lo[:, :c]
        grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(c, BLOCK_V))
        _bwd_grad_logits_kernel[grid](
            hidden, weight, tg, log_z, entropy if g_ent is not None else dummy,
            g_lp if g_lp is not None else dummy, g_ent if g_ent is not None else dummy, gc, glc,
            n, c, hd, hidden.stride(0), weight.stride(0), g.stride(0), c0, float(temperature),
            HAS_GLP=g_lp is not None, HAS_GENT=g_ent is not None, SCALED=float(temperature) != 1.0,
            BLOCK_N=BLOCK_N, BLOCK_V=BLOCK_V,
            BLOCK_H=BLOCK_H, PRECISION=_precision(hidden.dtype), UPCAST=_upcast(hidden.dtype), SPLIT=split,
            num_warps=NUM_WARPS)
        w_c = weight[c0:c0 + c]
        if need_h:
            grad_h += _mm_fp32(gc, w_c)
        if need_w and main_grad is not None:
            main_grad[c0:c0 + c] += _mm_fp32(gc.t(), hidden)
            if split:
                main_grad[c0:c0 + c] += _mm_fp32(glc.t(), hidden)
        elif need_w:
            grad_w[c0:c0 + c] = gc.t() @ hidden
    return grad_h, grad_w
