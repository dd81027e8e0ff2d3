"""Triton half of `dual_context_divergence.py` (imported lazily; set TRITON_INTERPRET=1 before importing it to run on
CPU).

The design of `logprob_triton.py` (its docstring says why): per vocabulary chunk one GEMM with half-precision inputs
and an fp32 output (cuBLAS) and a Triton epilogue that reads the chunk once. Both contexts share each weight read: the
skill and the original hidden rows are stacked into one [2N, H] operand, so one GEMM gives the chunk's skill logits
a (rows 0..N-1) and original logits b (rows N..2N-1), fp32 [2N, C] of at most CHUNK_BYTES
(`logprob.triton_chunk_columns(2N, V)`).

Forward (`local_partials`): `_stats_kernel` (autotuned) reduces each split of SPLIT columns of each row pair to the 8
statistics of `dual_context_divergence._local_partials_torch` (m_s, s_s, a_num, m_o, s_o, b_num, t_s, t_o) in one
buffer, merged once at the end. Top-k of p_s: per chunk `torch.topk` of the skill logits (a radix selection: one
pass over the chunk, no k rounds of max extraction) with the original logits at the same ids, merged into the
running top-k (2k candidates -> k) by `dual_context_divergence._merge_topk`.

Backward (`backward`): the chunks in reverse order, the last ones kept from the forward (`saved_bytes`, default one
chunk), the others recomputed (only the original rows when no KL needs a gradient: [N, C]); `_grad_kernel`
(autotuned) writes d loss / d b in the input dtype (hi + lo for an fp32 main_grad), then two GEMMs give grad_h_orig
(fp32 accumulation) and the chunk's weight gradient. The skill side is a stop-gradient (teacher).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from .dual_context_divergence import _merge_topk
from .logprob import triton_chunk_columns
from .logprob_triton import autotuned, check_inputs, chunk_pass, chunks_of, kept_chunks, launch, mm_fp32, slots_of

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

# the interpreter's one configuration (tests shrink them to exercise multi-tile paths at small shapes)
BLOCK_N = 16
BLOCK_V = 128
SPLIT = 2048  # columns of a chunk one stats program reduces
N_STATS = 8   # m_s, s_s, a_num, m_o, s_o, b_num, t_s, t_o
_NAME = "dual_context_divergence"


@triton.jit
def _stats_kernel(x_ptr, tgt_ptr, part_ptr, N, C, stride_x, c0, slot0, plane, temperature, ROWS_BUCKET,
                  SPLIT: tl.constexpr, SCALED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """Program (i, j): row pairs [i*BLOCK_N, ...) (skill row r of the fp32 chunk x [2N, C], original row N + r),
    columns [j*SPLIT, (j+1)*SPLIT): their 8 statistics at slot slot0 + j of part [8, slots, N]."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    tgt = tl.load(tgt_ptr + rows, mask=row_mask, other=-1) - c0
    m_s = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    m_o = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    s_s = tl.zeros([BLOCK_N], dtype=tl.float32)
    s_o = tl.zeros([BLOCK_N], dtype=tl.float32)
    a_num = tl.zeros([BLOCK_N], dtype=tl.float32)
    b_num = tl.zeros([BLOCK_N], dtype=tl.float32)
    t_s = tl.zeros([BLOCK_N], dtype=tl.float32)
    t_o = tl.zeros([BLOCK_N], dtype=tl.float32)
    lo = pid_s * SPLIT
    hi = tl.minimum(lo + SPLIT, C)
    a_base = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    b_base = x_ptr + (rows + N).to(tl.int64)[:, None] * stride_x
    for v0 in range(lo, hi, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        mask = row_mask[:, None] & (cols < hi)[None, :]
        a = tl.load(a_base + cols[None, :], mask=mask, other=0.0)
        b = tl.load(b_base + cols[None, :], mask=mask, other=0.0)
        if SCALED:
            a = a / temperature
            b = b / temperature
        diff = a - b  # finite (0 where masked)
        a = tl.where(mask, a, float("-inf"))
        b = tl.where(mask, b, float("-inf"))
        hit = (cols[None, :] == tgt[:, None]) & mask
        t_s += tl.sum(tl.where(hit, a, 0.0), axis=1)
        t_o += tl.sum(tl.where(hit, b, 0.0), axis=1)
        new_ms = tl.maximum(m_s, tl.max(a, axis=1))
        new_mo = tl.maximum(m_o, tl.max(b, axis=1))
        ref_s = tl.where(new_ms == float("-inf"), 0.0, new_ms)
        ref_o = tl.where(new_mo == float("-inf"), 0.0, new_mo)
        alpha_s = tl.exp(m_s - ref_s)
        alpha_o = tl.exp(m_o - ref_o)
        e_s = tl.where(mask, tl.exp(a - ref_s[:, None]), 0.0)
        e_o = tl.where(mask, tl.exp(b - ref_o[:, None]), 0.0)
        s_s = s_s * alpha_s + tl.sum(e_s, axis=1)
        a_num = a_num * alpha_s + tl.sum(e_s * diff, axis=1)
        s_o = s_o * alpha_o + tl.sum(e_o, axis=1)
        b_num = b_num * alpha_o - tl.sum(e_o * diff, axis=1)
        m_s = new_ms
        m_o = new_mo
    out = (slot0 + pid_s) * N + rows
    tl.store(part_ptr + out, m_s, mask=row_mask)
    tl.store(part_ptr + plane + out, s_s, mask=row_mask)
    tl.store(part_ptr + 2 * plane + out, a_num, mask=row_mask)
    tl.store(part_ptr + 3 * plane + out, m_o, mask=row_mask)
    tl.store(part_ptr + 4 * plane + out, s_o, mask=row_mask)
    tl.store(part_ptr + 5 * plane + out, b_num, mask=row_mask)
    tl.store(part_ptr + 6 * plane + out, t_s, mask=row_mask)
    tl.store(part_ptr + 7 * plane + out, t_o, mask=row_mask)


@triton.jit
def _grad_kernel(x_ptr, tgt_ptr, lses_ptr, lseo_ptr, klr_ptr, glo_ptr, gkf_ptr, gkr_ptr, g_ptr, glow_ptr, N, C,
                 stride_x, b_row0, stride_g, c0, temperature, ROWS_BUCKET, HAS_GLO: tl.constexpr,
                 HAS_GKF: tl.constexpr, HAS_GKR: tl.constexpr, NEED_S: tl.constexpr, SCALED: tl.constexpr,
                 HI_LO: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """d loss / d b of a chunk: original logits at rows b_row0 + r of x, skill logits at rows r (NEED_S)."""
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = row_mask[:, None] & (cols < C)[None, :]
    b = tl.load(x_ptr + (rows + b_row0).to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if SCALED:
        b = b / temperature
    lo = b - tl.load(lseo_ptr + rows, mask=row_mask, other=0.0)[:, None]  # log p_o
    po = tl.exp(lo)
    grad = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    if NEED_S:
        a = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        if SCALED:
            a = a / temperature
        ls = a - tl.load(lses_ptr + rows, mask=row_mask, other=0.0)[:, None]  # log p_s
        if HAS_GKR:  # d KL(p_o || p_s) / d b_v = p_o (log p_o - log p_s - KL)
            klr = tl.load(klr_ptr + rows, mask=row_mask, other=0.0)
            gkr = tl.load(gkr_ptr + rows, mask=row_mask, other=0.0)
            grad += gkr[:, None] * po * (lo - ls - klr[:, None])
        if HAS_GKF:  # d KL(p_s || p_o) / d b_v = p_o - p_s
            gkf = tl.load(gkf_ptr + rows, mask=row_mask, other=0.0)
            grad += gkf[:, None] * (po - tl.exp(ls))
    if HAS_GLO:  # d log p_o(y) / d b_v = 1[v = y] - p_o
        tgt = tl.load(tgt_ptr + rows, mask=row_mask, other=-1) - c0
        glo = tl.load(glo_ptr + rows, mask=row_mask, other=0.0)
        grad += glo[:, None] * ((cols[None, :] == tgt[:, None]).to(tl.float32) - po)
    if SCALED:
        grad = grad / temperature
    offs = rows.to(tl.int64)[:, None] * stride_g + cols[None, :]
    hi = grad.to(g_ptr.dtype.element_ty)
    tl.store(g_ptr + offs, hi, mask=mask)
    if HI_LO:  # hi + lo = the fp32 tile to ~2^-16 (logprob_triton: fp32 main_grad accumulation)
        tl.store(glow_ptr + offs, (grad - hi.to(tl.float32)).to(glow_ptr.dtype.element_ty), mask=mask)


_stats_tuned = autotuned(_stats_kernel)
_grad_tuned = autotuned(_grad_kernel)


def _merge(parts: torch.Tensor) -> dict:
    """The [8, slots, N] partials merged over the slots (each context: max, rescaled sums)."""
    m_s, s_s, a_num, m_o, s_o, b_num, t_s, t_o = parts
    big_s, big_o = m_s.max(dim=0).values, m_o.max(dim=0).values
    al_s, al_o = torch.exp(m_s - big_s), torch.exp(m_o - big_o)  # every slot has finite logits: finite maxima
    return {"m_s": big_s, "s_s": (s_s * al_s).sum(0), "a_num": (a_num * al_s).sum(0),
            "m_o": big_o, "s_o": (s_o * al_o).sum(0), "b_num": (b_num * al_o).sum(0),
            "t_s": t_s.sum(0), "t_o": t_o.sum(0)}


def local_partials(h_skill, h_orig, weight, targets_local, topk: int, temperature: float = 1.0,
                   chunk_size: Optional[int] = None, keep: int = 0):
    """The per-row partials of `dual_context_divergence._local_partials_torch`, and {c0: fp32 [2N, C] logits} of the
    last `keep` chunks (for the backward)."""
    check_inputs(_NAME, h_orig, h_skill, weight)
    n = h_orig.shape[0]
    v = weight.shape[0]
    dev = h_orig.device
    both = torch.cat([h_skill, h_orig])  # [2N, H]: one GEMM per chunk for both contexts
    chunks = chunks_of(v, chunk_size or triton_chunk_columns(2 * n, v))
    parts = torch.empty(N_STATS, slots_of(chunks, SPLIT), n, device=dev, dtype=torch.float32)
    tg = targets_local.contiguous()
    scaled = float(temperature) != 1.0
    tk = (torch.empty(n, 0, device=dev), torch.empty(n, 0, dtype=torch.long, device=dev), torch.empty(n, 0, device=dev))
    kept = {}
    for c0, c, slot, splits, logits in chunk_pass(both, weight, chunks, SPLIT, keep, kept):
        if n:
            launch(_stats_kernel, _stats_tuned, (BLOCK_N, BLOCK_V), splits, n, logits, tg, parts, n, c,
                   logits.stride(0), c0, slot, parts.stride(0), float(temperature), SPLIT=SPLIT, SCALED=scaled)
        if topk > 0 and n:
            vals, ids = logits[:n].topk(min(topk, c), dim=1)
            bvals = logits[n:].gather(1, ids)
            if scaled:
                vals, bvals = vals / temperature, bvals / temperature
            tk = _merge_topk(*tk, vals, ids + c0, bvals, topk)
    out = _merge(parts[:, :slots_of(chunks, SPLIT)])
    out.update(found=(targets_local >= 0) & (targets_local < v), topk=tk if topk > 0 else None)
    return out, kept


def backward(h_skill, h_orig, weight, targets_local, lse_s, lse_o, kl_os, g_lo_rows, g_kf, g_kr, need_h, need_w,
             temperature: float = 1.0, main_grad=None, chunk_size: Optional[int] = None, kept: Optional[dict] = None):
    """(grad_h fp32, grad_w); with ``main_grad`` the weight gradient is added to it in fp32 (grad_w None). `kept`:
    {c0: fp32 [2N, C] logits} from the forward (consumed)."""
    check_inputs(_NAME, h_orig, h_skill, weight)
    n, hd = h_orig.shape
    v = weight.shape[0]
    dev = h_orig.device
    kept = kept if kept is not None else {}
    grad_h = torch.zeros(n, hd, device=dev, dtype=torch.float32) if need_h else None
    grad_w = torch.empty_like(weight) if need_w and main_grad is None else None
    if n == 0:
        if grad_w is not None:
            grad_w.zero_()
        return grad_h, grad_w
    need_s = g_kf is not None or g_kr is not None
    hi_lo = main_grad is not None and need_w and h_orig.dtype != torch.float32
    both = torch.cat([h_skill, h_orig]) if need_s else None
    dummy = lse_o  # any float32 tensor for unused pointers
    tg = targets_local.contiguous()
    for c0, c in reversed(chunks_of(v, chunk_size or triton_chunk_columns(2 * n, v))):
        w_c = weight[c0:c0 + c]
        logits = kept.pop(c0, None)
        b_row0 = n
        if logits is None:
            logits = mm_fp32(both, w_c.t()) if need_s else mm_fp32(h_orig, w_c.t())
            b_row0 = n if need_s else 0
        g = torch.empty(n, c, device=dev, dtype=h_orig.dtype)
        g_low = torch.empty_like(g) if hi_lo else g
        launch(_grad_kernel, _grad_tuned, (BLOCK_N, BLOCK_V), lambda bv: triton.cdiv(c, bv), n, logits, tg, lse_s,
               lse_o, kl_os, g_lo_rows if g_lo_rows is not None else dummy, g_kf if g_kf is not None else dummy,
               g_kr if g_kr is not None else dummy, g, g_low, n, c, logits.stride(0), b_row0, g.stride(0), c0,
               float(temperature), HAS_GLO=g_lo_rows is not None, HAS_GKF=g_kf is not None,
               HAS_GKR=g_kr is not None, NEED_S=need_s, SCALED=float(temperature) != 1.0, HI_LO=hi_lo)
        del logits
        if need_h:
            grad_h += mm_fp32(g, w_c)
        if need_w and main_grad is not None:
            main_grad[c0:c0 + c] += mm_fp32(g.t(), h_orig)
            if hi_lo:
                main_grad[c0:c0 + c] += mm_fp32(g_low.t(), h_orig)
        elif need_w:
            torch.mm(g.t(), h_orig, out=grad_w[c0:c0 + c])
    return grad_h, grad_w
