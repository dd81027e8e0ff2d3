"""Triton half of `fork_attention.py` (imported lazily; set TRITON_INTERPRET=1 before importing it to run on CPU).

Flash-attention forward over a fork-packed batch. Program (m, g, h) takes query block m of group g, head h.
Its rows may see (a) the group's prefix keys [group_start, prefix_end) causally and (b) keys of their own run from
seg_start[first row] up to the block's last row. Only those key blocks are visited: the blocks of the other
branches in between are skipped entirely. Prefix blocks that lie wholly before the block's first row are visible to
every row of it and run without any element mask (for a branch's query block: every prefix block but a partial last
one); inside the other visited blocks an element mask applies the exact rule (j <= i, and j in the prefix or
j >= seg_start[i]). Online softmax in base 2 with fp32 running max / sum / accumulator; the output is written in q's
dtype.

Tiles: on a GPU the kernel is autotuned over CONFIGS (BLOCK_M query rows x BLOCK_N keys, warps, pipeline stages;
keyed by head dim, GQA group and the power-of-two bucket of the longest group), pruned by input width: fp32 tiles
are twice as large, so their key blocks stay <= 64 with at most 2 stages (shared memory of an A100: 164 KB, H100 /
H200: 228 KB, head_dim up to 128). The interpreter runs the module's BLOCK_M / BLOCK_N (tests shrink them); so
does the GPU with AUTOTUNE = False (the kernel tests).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

# the interpreter's one configuration (tests shrink BLOCK_M / BLOCK_N)
BLOCK_M = 64
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 2
# GPU configurations: (BLOCK_M, BLOCK_N, warps, stages)
CONFIGS = [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 8, 2), (64, 32, 4, 2)]
AUTOTUNE = True  # False: the GPU runs BLOCK_M / BLOCK_N too (the kernel tests)


def _prune(configs, named_args, **kwargs):
    """fp32 inputs: key blocks <= 64 and <= 2 stages; head_dim > 128: key blocks <= 64 (shared memory)."""
    fp32 = named_args["q_ptr"].dtype == torch.float32
    wide = named_args["HEAD_DIM"] > 128
    kept = [c for c in configs if not ((fp32 or wide) and c.kwargs["BLOCK_N"] > 64)
            and not (fp32 and c.num_stages > 2)]
    return kept or configs[-1:]


def _configs():
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in CONFIGS]


@triton.jit
def _attend_block(acc, m_i, l_i, q, k_ptr, v_ptr, n0, rows, row_seg, key_lo, key_hi, stride_k, stride_v, dcols,
                  d_mask, qk_scale, MASKED: tl.constexpr, IS_PREFIX: tl.constexpr, BLOCK_N: tl.constexpr,
                  PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One key block into the running softmax. MASKED=False: a block every row sees whole (no element mask)."""
    cols = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        kv_mask = (cols >= key_lo) & (cols < key_hi)
        ld_mask = kv_mask[:, None] & d_mask[None, :]
    else:
        ld_mask = d_mask[None, :]
    k = tl.load(k_ptr + cols[:, None] * stride_k + dcols[None, :], mask=ld_mask, other=0.0)
    v = tl.load(v_ptr + cols[:, None] * stride_v + dcols[None, :], mask=ld_mask, other=0.0)
    if UPCAST:  # the CPU interpreter's dot mis-reads bf16 (raw uint16): use exact fp32 copies there
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if MASKED:
        visible = kv_mask[None, :] & (cols[None, :] <= rows[:, None])
        if not IS_PREFIX:
            visible = visible & (cols[None, :] >= row_seg[:, None])
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _fork_attn_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, cu_ptr, pend_ptr, seg_ptr,
                          stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh,
                          HEAD_DIM, GQA_GROUP, qk_scale, SEQ_BUCKET,
                          BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    g = tl.program_id(1)
    h = tl.program_id(2)
    g_start = tl.load(cu_ptr + g)
    g_end = tl.load(cu_ptr + g + 1)
    m0 = g_start + pid_m * BLOCK_M
    if m0 < g_end:
        pend = tl.load(pend_ptr + g)
        rows = m0 + tl.arange(0, BLOCK_M)
        row_mask = rows < g_end
        row_seg = tl.load(seg_ptr + rows, mask=row_mask, other=0)
        seg_lo = tl.load(seg_ptr + m0)
        q_hi = tl.minimum(m0 + BLOCK_M, g_end)  # keys beyond the block's last row are never visible
        dcols = tl.arange(0, BLOCK_D)
        d_mask = dcols < HEAD_DIM
        kvh = h // GQA_GROUP
        q = tl.load(q_ptr + rows[:, None] * stride_qn + h * stride_qh + dcols[None, :],
                    mask=row_mask[:, None] & d_mask[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        k_base = k_ptr + kvh * stride_kh
        v_base = v_ptr + kvh * stride_vh
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        # (a) the shared prefix, causally: whole blocks before the first row unmasked, the rest masked
        pre_hi = tl.minimum(pend, q_hi)
        full_hi = g_start + (tl.minimum(pend, m0) - g_start) // BLOCK_N * BLOCK_N
        for n0 in range(g_start, full_hi, BLOCK_N):
            acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, k_base, v_base, n0, rows, row_seg, g_start, pre_hi,
                                          stride_kn, stride_vn, dcols, d_mask, qk_scale, False, True, BLOCK_N,
                                          PRECISION, UPCAST)
        for n0 in range(full_hi, pre_hi, BLOCK_N):
            acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, k_base, v_base, n0, rows, row_seg, g_start, pre_hi,
                                          stride_kn, stride_vn, dcols, d_mask, qk_scale, True, True, BLOCK_N,
                                          PRECISION, UPCAST)
        # (b) the block's own branch run(s): from the first row's run start (never before the prefix end)
        own_lo = tl.maximum(seg_lo, pend)
        for n0 in range(own_lo, q_hi, BLOCK_N):
            acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, k_base, v_base, n0, rows, row_seg, own_lo, q_hi,
                                          stride_kn, stride_vn, dcols, d_mask, qk_scale, True, False, BLOCK_N,
                                          PRECISION, UPCAST)
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        out = acc / l_safe[:, None]
        tl.store(o_ptr + rows[:, None] * stride_on + h * stride_oh + dcols[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & d_mask[None, :])


_fork_attn_fwd_tuned = None if INTERPRETED else triton.autotune(
    configs=_configs(), key=["HEAD_DIM", "GQA_GROUP", "SEQ_BUCKET"], prune_configs_by={"early_config_prune": _prune},
)(_fork_attn_fwd_kernel)


def tiles() -> tuple:
    """(BLOCK_M, BLOCK_N) of the last launch: the autotuner's choice on a GPU (the module's BLOCK_M / BLOCK_N under
    the interpreter, with AUTOTUNE off and before any launch)."""
    best = getattr(_fork_attn_fwd_tuned, "best_config", None) if AUTOTUNE else None
    return (best.kwargs["BLOCK_M"], best.kwargs["BLOCK_N"]) if best is not None else (BLOCK_M, BLOCK_N)


def fork_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta, scale: float) -> torch.Tensor:
    n, hq, d = q.shape
    hkv = k.shape[1]
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    num_groups = meta.cu_seqlens.numel() - 1
    if num_groups == 0 or meta.max_seqlen == 0:
        return out
    block_d = max(16, triton.next_power_of_2(d))
    upcast = INTERPRETED and q.dtype == torch.bfloat16
    precision = "ieee" if (q.dtype == torch.float32 or upcast) else "tf32"
    cu = meta.cu_seqlens.to(q.device)
    pend = meta.prefix_end.to(q.device)
    seg = meta.seg_start.to(q.device)
    args = (q, k, v, out, cu, pend, seg, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), d, hq // hkv, scale * 1.4426950408889634,
            triton.next_power_of_2(meta.max_seqlen))
    consts = dict(BLOCK_D=block_d, PRECISION=precision, UPCAST=upcast)
    if INTERPRETED or not AUTOTUNE:
        _fork_attn_fwd_kernel[(triton.cdiv(meta.max_seqlen, BLOCK_M), num_groups, hq)](
            *args, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS, num_stages=NUM_STAGES, **consts)
    else:
        _fork_attn_fwd_tuned[lambda meta_: (triton.cdiv(meta.max_seqlen, meta_["BLOCK_M"]), num_groups, hq)](
            *args, **consts)
    return out
