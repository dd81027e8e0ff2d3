"""Triton half of `dual_context_divergence.py` (imported lazily; TRITON_INTERPRET=1 before importing it for CPU).

Forward (`local_partials`): program (i, j) takes BLOCK_N rows and the j-th vocabulary split of this shard and loops
over its vocabulary tiles; each weight tile is loaded once and multiplied with both hidden tiles (skill, original),
fp32 accumulation. Per row it keeps the running max / sum-exp of both contexts, the two KL numerators
A = sum exp(a - m_s)(a - b), B = sum exp(b - m_o)(b - a) (rescaled as the maxima move), the two target logits, and
with TOPK = k > 0 a running top-k of the skill logits (with the original logits at those ids) merged in registers
by k rounds of max extraction. Logits never leave registers; per-split partials are merged in torch.

Backward (`backward`): per vocabulary chunk a kernel recomputes the logits tiles (the skill tile only when a KL has a
gradient) and writes d loss / d b for the chunk ([N, chunk] in the input dtype); cuBLAS turns it into grad_h_orig
(fp32 accumulation) and the chunk's weight-gradient rows.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .logprob_triton import _mm_fp32

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

# tile sizes; tests shrink them (module attributes) to exercise multi-tile paths at small shapes
BLOCK_N = 32
BLOCK_V = 128
BLOCK_H = 64
NUM_WARPS = 8
BWD_CHUNK = 8192
TARGET_PROGRAMS = 1024
NUM_SPLITS = None  # force a number of vocabulary splits (tests); None = automatic
N_STATS = 8        # m_s, s_s, a_num, m_o, s_o, b_num, t_s, t_o


@triton.jit
def _dual_logits_tile(hs_ptr, ho_ptr, w_ptr, rows, cols, row_mask, col_mask, HD, stride_hs, stride_ho, stride_w,
                      BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr,
                      UPCAST: tl.constexpr, NEED_S: tl.constexpr):
    acc_s = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    acc_o = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    for k0 in range(0, HD, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)
        k_mask = ks < HD
        hmask = row_mask[:, None] & k_mask[None, :]
        w = tl.load(w_ptr + cols[None, :] * stride_w + ks[:, None], mask=col_mask[None, :] & k_mask[:, None], other=0.0)
        ho = tl.load(ho_ptr + rows[:, None] * stride_ho + ks[None, :], mask=hmask, other=0.0)
        if UPCAST:  # the CPU interpreter's dot mis-reads bf16: multiply exact fp32 copies
            w = w.to(tl.float32)
            ho = ho.to(tl.float32)
        acc_o = tl.dot(ho, w, acc_o, input_precision=PRECISION)
        if NEED_S:
            hs = tl.load(hs_ptr + rows[:, None] * stride_hs + ks[None, :], mask=hmask, other=0.0)
            if UPCAST:
                hs = hs.to(tl.float32)
            acc_s = tl.dot(hs, w, acc_s, input_precision=PRECISION)
    return acc_s, acc_o


@triton.jit
def _merge_topk(run_v, run_i, run_b, a, b, cols, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, K: tl.constexpr,
                KP: tl.constexpr):
    """Top-K of (running set U tile) by the skill logit a, carrying id and original logit b; K rounds of max
    extraction. Masked tile columns hold a = -inf."""
    kcols = tl.arange(0, KP)
    lcols = tl.arange(0, BLOCK_V)
    new_v = tl.full([BLOCK_N, KP], float("-inf"), tl.float32)
    new_i = tl.full([BLOCK_N, KP], -1, tl.int32)
    new_b = tl.full([BLOCK_N, KP], float("-inf"), tl.float32)
    for j in range(K):  # a runtime loop: unrolling K rounds makes the compile slow (~1 min for K = 32)
        mr = tl.max(run_v, axis=1)
        jr = tl.argmax(run_v, axis=1)
        mt = tl.max(a, axis=1)
        jt = tl.argmax(a, axis=1)
        take_t = mt > mr
        at_r = kcols[None, :] == jr[:, None]
        at_t = lcols[None, :] == jt[:, None]
        id_r = tl.sum(tl.where(at_r, run_i, 0), axis=1)
        b_r = tl.sum(tl.where(at_r, run_b, 0.0), axis=1)
        id_t = tl.sum(tl.where(at_t, cols[None, :], 0), axis=1)
        b_t = tl.sum(tl.where(at_t, b, 0.0), axis=1)
        put = kcols[None, :] == j
        new_v = tl.where(put, tl.where(take_t, mt, mr)[:, None], new_v)
        new_i = tl.where(put, tl.where(take_t, id_t, id_r)[:, None], new_i)
        new_b = tl.where(put, tl.where(take_t, b_t, b_r)[:, None], new_b)
        a = tl.where(take_t[:, None] & at_t, float("-inf"), a)
        run_v = tl.where((mt <= mr)[:, None] & at_r, float("-inf"), run_v)
    return new_v, new_i, new_b


@triton.jit
def _fwd_kernel(hs_ptr, ho_ptr, w_ptr, tgt_ptr, stats_ptr, topv_ptr, topi_ptr, topb_ptr,
                N, V, HD, stride_hs, stride_ho, stride_w, v_per_split, n_splits, temperature,
                SCALED: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    tgt = tl.load(tgt_ptr + rows, mask=row_mask, other=-1)
    m_s = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    m_o = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    s_s = tl.zeros([BLOCK_N], dtype=tl.float32)
    s_o = tl.zeros([BLOCK_N], dtype=tl.float32)
    a_num = tl.zeros([BLOCK_N], dtype=tl.float32)
    b_num = tl.zeros([BLOCK_N], dtype=tl.float32)
    t_s = tl.zeros([BLOCK_N], dtype=tl.float32)
    t_o = tl.zeros([BLOCK_N], dtype=tl.float32)
    run_v = tl.full([BLOCK_N, KP], float("-inf"), tl.float32)
    run_i = tl.full([BLOCK_N, KP], -1, tl.int32)
    run_b = tl.full([BLOCK_N, KP], float("-inf"), tl.float32)
    v_begin = pid_s * v_per_split
    v_end = tl.minimum(v_begin + v_per_split, V)
    for v0 in range(v_begin, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_mask = cols < v_end
        a, b = _dual_logits_tile(hs_ptr, ho_ptr, w_ptr, rows, cols, row_mask, col_mask, HD, stride_hs, stride_ho,
                                 stride_w, BLOCK_N, BLOCK_V, BLOCK_H, PRECISION, UPCAST, True)
        if SCALED:
            a = a / temperature
            b = b / temperature
        diff = tl.where(col_mask[None, :], a - b, 0.0)  # before masking: both logits are finite here
        a = tl.where(col_mask[None, :], a, float("-inf"))
        b = tl.where(col_mask[None, :], b, float("-inf"))
        hit = (cols[None, :] == tgt[:, None]) & col_mask[None, :]
        t_s += tl.sum(tl.where(hit, a, 0.0), axis=1)
        t_o += tl.sum(tl.where(hit, b, 0.0), axis=1)
        new_ms = tl.maximum(m_s, tl.max(a, axis=1))
        new_mo = tl.maximum(m_o, tl.max(b, axis=1))
        alpha_s = tl.exp(m_s - new_ms)
        alpha_o = tl.exp(m_o - new_mo)
        e_s = tl.where(col_mask[None, :], tl.exp(a - new_ms[:, None]), 0.0)
        e_o = tl.where(col_mask[None, :], tl.exp(b - new_mo[:, None]), 0.0)
        s_s = s_s * alpha_s + tl.sum(e_s, axis=1)
        a_num = a_num * alpha_s + tl.sum(e_s * diff, axis=1)
        s_o = s_o * alpha_o + tl.sum(e_o, axis=1)
        b_num = b_num * alpha_o - tl.sum(e_o * diff, axis=1)
        m_s = new_ms
        m_o = new_mo
        if K > 0:
            # merge only when some row's tile max beats its current k-th value (rare after the first tiles)
            kth = tl.min(tl.where(tl.arange(0, KP)[None, :] < K, run_v, float("inf")), axis=1)
            if tl.max(tl.where(row_mask, tl.max(a, axis=1) - kth, float("-inf")), axis=0) > 0:
                run_v, run_i, run_b = _merge_topk(run_v, run_i, run_b, a, b, cols, BLOCK_N, BLOCK_V, K, KP)
    plane = n_splits * N
    out = pid_s * N + rows
    tl.store(stats_ptr + out, m_s, mask=row_mask)
    tl.store(stats_ptr + plane + out, s_s, mask=row_mask)
    tl.store(stats_ptr + 2 * plane + out, a_num, mask=row_mask)
    tl.store(stats_ptr + 3 * plane + out, m_o, mask=row_mask)
    tl.store(stats_ptr + 4 * plane + out, s_o, mask=row_mask)
    tl.store(stats_ptr + 5 * plane + out, b_num, mask=row_mask)
    tl.store(stats_ptr + 6 * plane + out, t_s, mask=row_mask)
    tl.store(stats_ptr + 7 * plane + out, t_o, mask=row_mask)
    if K > 0:
        kcols = tl.arange(0, KP)
        offs = out[:, None] * KP + kcols[None, :]
        tmask = row_mask[:, None] & (kcols[None, :] < K)
        tl.store(topv_ptr + offs, run_v, mask=tmask)
        tl.store(topi_ptr + offs, run_i, mask=tmask)
        tl.store(topb_ptr + offs, run_b, mask=tmask)


@triton.jit
def _bwd_kernel(hs_ptr, ho_ptr, w_ptr, tgt_ptr, lses_ptr, lseo_ptr, klr_ptr, glo_ptr, gkf_ptr, gkr_ptr, g_ptr,
                glow_ptr, N, C, HD, stride_hs, stride_ho, stride_w, stride_g, c0, temperature,
                HAS_GLO: tl.constexpr, HAS_GKF: tl.constexpr, HAS_GKR: tl.constexpr, NEED_S: tl.constexpr,
                SCALED: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr,
                UPCAST: tl.constexpr, SPLIT: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    lcols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = lcols < C
    cols = c0 + lcols
    a, b = _dual_logits_tile(hs_ptr, ho_ptr, w_ptr, rows, cols, row_mask, col_mask, HD, stride_hs, stride_ho,
                             stride_w, BLOCK_N, BLOCK_V, BLOCK_H, PRECISION, UPCAST, NEED_S)
    if SCALED:
        a = a / temperature
        b = b / temperature
    lse_o = tl.load(lseo_ptr + rows, mask=row_mask, other=0.0)
    lo = b - lse_o[:, None]
    po = tl.exp(lo)
    grad = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    if NEED_S:
        lse_s = tl.load(lses_ptr + rows, mask=row_mask, other=0.0)
        ls = a - lse_s[:, None]
        if HAS_GKR:
            klr = tl.load(klr_ptr + rows, mask=row_mask, other=0.0)
            gkr = tl.load(gkr_ptr + rows, mask=row_mask, other=0.0)
            grad += gkr[:, None] * po * (lo - ls - klr[:, None])
        if HAS_GKF:
            gkf = tl.load(gkf_ptr + rows, mask=row_mask, other=0.0)
            grad += gkf[:, None] * (po - tl.exp(ls))
    if HAS_GLO:
        tgt = tl.load(tgt_ptr + rows, mask=row_mask, other=-1)
        glo = tl.load(glo_ptr + rows, mask=row_mask, other=0.0)
        onehot = (cols[None, :] == tgt[:, None]).to(tl.float32)
        grad += glo[:, None] * (onehot - po)
    if SCALED:
        grad = grad / temperature
    hi = grad.to(g_ptr.dtype.element_ty)
    tl.store(g_ptr + rows[:, None] * stride_g + lcols[None, :], hi, mask=row_mask[:, None] & col_mask[None, :])
    if SPLIT:  # hi + lo = the fp32 tile to ~2^-16 (logprob_triton: fp32 main_grad accumulation)
        tl.store(glow_ptr + rows[:, None] * stride_g + lcols[None, :], (grad - hi.to(tl.float32)).to(
            glow_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def _upcast(dtype: torch.dtype) -> bool:
    return INTERPRETED and dtype == torch.bfloat16


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs: exact fp32 products (no TF32), so the values match the torch path to fp32 rounding
    return "ieee" if dtype == torch.float32 or _upcast(dtype) else "tf32"


def _check(h_skill, h_orig, weight):
    if h_orig.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dual_context_divergence[triton]: unsupported dtype {h_orig.dtype}")
    if h_skill.stride(1) != 1 or h_orig.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("dual_context_divergence[triton]: hidden rows and weight need a contiguous last dimension")


def local_partials(h_skill, h_orig, weight, targets_local, topk: int, temperature: float = 1.0) -> dict:
    """The per-row partials of `dual_context_divergence._local_partials_torch`, from the fused kernel."""
    _check(h_skill, h_orig, weight)
    n, hd = h_orig.shape
    v = weight.shape[0]
    dev = h_orig.device
    n_blocks = max(1, triton.cdiv(n, BLOCK_N))
    v_tiles = triton.cdiv(v, BLOCK_V)
    if NUM_SPLITS is not None:
        splits = max(1, min(int(NUM_SPLITS), v_tiles))
    else:
        splits = max(1, min(v_tiles, triton.cdiv(TARGET_PROGRAMS, n_blocks)))
    v_per_split = triton.cdiv(v_tiles, splits) * BLOCK_V
    splits = triton.cdiv(v, v_per_split)  # every split non-empty
    kp = triton.next_power_of_2(topk) if topk > 0 else 1
    stats = torch.empty(N_STATS, splits, n, device=dev, dtype=torch.float32)
    topv = torch.empty(splits, n, kp, device=dev, dtype=torch.float32)
    topi = torch.empty(splits, n, kp, device=dev, dtype=torch.int32)
    topb = torch.empty(splits, n, kp, device=dev, dtype=torch.float32)
    tg = targets_local.contiguous()
    if n > 0:
        _fwd_kernel[(n_blocks, splits)](
            h_skill, h_orig, weight, tg, stats, topv, topi, topb, n, v, hd, h_skill.stride(0), h_orig.stride(0),
            weight.stride(0), v_per_split, splits, float(temperature), SCALED=float(temperature) != 1.0, K=int(topk),
            KP=kp, BLOCK_N=BLOCK_N, BLOCK_V=BLOCK_V, BLOCK_H=BLOCK_H, PRECISION=_precision(h_orig.dtype),
            UPCAST=_upcast(h_orig.dtype), num_warps=NUM_WARPS)
    m_s, s_s, a_num, m_o, s_o, b_num, t_s, t_o = stats.unbind(0)  # each [splits, N]
    big_s, big_o = m_s.max(dim=0).values, m_o.max(dim=0).values
    al_s, al_o = torch.exp(m_s - big_s), torch.exp(m_o - big_o)
    parts = {"m_s": big_s, "s_s": (s_s * al_s).sum(0), "a_num": (a_num * al_s).sum(0),
             "m_o": big_o, "s_o": (s_o * al_o).sum(0), "b_num": (b_num * al_o).sum(0),
             "t_s": t_s.sum(0), "t_o": t_o.sum(0), "found": (targets_local >= 0) & (targets_local < v), "topk": None}
    if topk > 0:
        vals = topv[:, :, :topk].permute(1, 0, 2).reshape(n, -1)
        ids = topi[:, :, :topk].permute(1, 0, 2).reshape(n, -1).long()
        bv = topb[:, :, :topk].permute(1, 0, 2).reshape(n, -1)
        vals, pos = vals.topk(min(topk, vals.shape[1]), dim=1)
        parts["topk"] = (vals, ids.gather(1, pos), bv.gather(1, pos))
    return parts


def backward(h_skill, h_orig, weight, targets_local, lse_s, lse_o, kl_os, g_lo_rows, g_kf, g_kr, need_h, need_w,
             temperature: float = 1.0, main_grad=None):
    """(grad_h fp32, grad_w); with ``main_grad`` the weight gradient is added to it in fp32 (grad_w None)."""
    _check(h_skill, h_orig, weight)
    n, hd = h_orig.shape
    v = weight.shape[0]
    dev = h_orig.device
    grad_h = torch.zeros(n, hd, device=dev, dtype=torch.float32) if need_h else None
    grad_w = torch.empty_like(weight) if need_w and main_grad is None else None
    if n == 0:
        if grad_w is not None:
            grad_w.zero_()
        return grad_h, grad_w
    chunk = min(v, BWD_CHUNK)
    g = torch.empty(n, chunk, device=dev, dtype=h_orig.dtype)
    split = main_grad is not None and need_w and h_orig.dtype != torch.float32
    g_lo = torch.empty_like(g) if split else g
    dummy = lse_o  # any float32 tensor for unused pointers
    tg = targets_local.contiguous()
    for c0 in range(0, v, chunk):
        c = min(chunk, v - c0)
        gc, glc = g[:, :c], g_lo[:, :c]
        grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(c, BLOCK_V))
        _bwd_kernel[grid](
            h_skill, h_orig, weight, tg, lse_s, lse_o, kl_os,
            g_lo_rows if g_lo_rows is not None else dummy, g_kf if g_kf is not None else dummy,
            g_kr if g_kr is not None else dummy, gc, glc, n, c, hd, h_skill.stride(0), h_orig.stride(0),
            weight.stride(0), g.stride(0), c0, float(temperature), HAS_GLO=g_lo_rows is not None,
            HAS_GKF=g_kf is not None, HAS_GKR=g_kr is not None,
            NEED_S=g_kf is not None or g_kr is not None, SCALED=float(temperature) != 1.0, BLOCK_N=BLOCK_N,
            BLOCK_V=BLOCK_V, BLOCK_H=BLOCK_H, PRECISION=_precision(h_orig.dtype), UPCAST=_upcast(h_orig.dtype),
            SPLIT=split, num_warps=NUM_WARPS)
        w_c = weight[c0:c0 + c]
        if need_h:
            grad_h += _mm_fp32(gc, w_c)
        if need_w and main_grad is not None:
            main_grad[c0:c0 + c] += _mm_fp32(gc.t(), h_orig)
            if split:
                main_grad[c0:c0 + c] += _mm_fp32(glc.t(), h_orig)
        elif need_w:
            grad_w[c0:c0 + c] = gc.t() @ h_orig
    return grad_h, grad_w
