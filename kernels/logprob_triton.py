"""Triton half of `logprob.py` (imported lazily; set TRITON_INTERPRET=1 before importing it to run on CPU).

Design: a cuBLAS GEMM per vocabulary chunk and a Triton epilogue that reads the chunk once.

Why this and not one Triton kernel that fuses the matmul with the online softmax (the previous design): the matmul
is all of the FLOPs (2·N·H·V against ~10·N·V for the softmax statistics), and a fused kernel re-streams the whole
weight once per block of rows (N / BLOCK_N passes over V·H·e bytes: 64 passes over 1.09 GB at Qwen2.5-7B's head with
N = 4,096), with fixed tiles far from what Hopper's tensor cores need; it reached 30-43 % of the H200's measured bf16
matmul rate and lost to the naive head. Here each chunk is one large GEMM (cuBLAS: tuned per GPU by its vendor,
bf16/fp16 inputs, fp32 accumulation AND fp32 output, so the log-probs keep fp32-level accuracy) that reads every
weight row exactly once per pass; the hidden rows are re-read once per chunk (N·H·e bytes, L2-resident at these
sizes). The price is one write and one read of the fp32 chunk (8 bytes per logit): at H = 3,584 that is ~18 % of the
GEMM's time on an H200 (4·rate / (H·bandwidth)), and memory stays one chunk: `logprob.triton_chunk_columns` sizes it
to CHUNK_BYTES of fp32 logits. This is how Liger-Kernel's fused linear cross-entropy and Cut Cross-Entropy's
reference path split the work (GEMM by cuBLAS, a Triton pass for the softmax statistics and the gradient); Liger
chunks the rows and computes the gradient inside the forward, which needs the loss's gradient per row at forward
time (a scalar for a mean cross-entropy). These log-probs feed a per-token loss whose gradient is known only after
the forward, so the backward runs after it, over vocabulary chunks, from the saved log-normaliser.

Forward (`local_partials`): per chunk, `mm_fp32(hidden, W_c^T)` -> fp32 [N, C]; `_stats_kernel` (autotuned: rows and
columns per program, warps, pipeline stages) reduces each split of SPLIT columns of each row to (max, sum-exp,
sum-exp*logit, target logit) into one partials buffer; all partials are merged once (`logprob.merge_partials`).

Backward (`backward`): the chunks in reverse order. The last chunks the forward computed are KEPT for it while
`saved_bytes` allows (default one chunk: the buffer the backward would otherwise allocate to recompute it, so the
kept chunk costs no extra peak), the others are recomputed by the same GEMM. `_grad_kernel` (autotuned) turns a
chunk into d loss / d logits in the input dtype (for a bf16/fp16 weight with an fp32 ``main_grad``, megatron DDP:
two halves hi + lo, ~16 mantissa bits, each multiplied into main_grad: megatron's gradient accumulation fusion), then
two GEMMs give grad_hidden (fp32 accumulation) and the chunk's weight gradient.

Temperature T: with SCALED (constexpr, T != 1) the epilogues divide each logit by T in fp32, and the backward's
d loss / d logits by T (chain rule of l / T); T = 1 compiles without either op.

Autotuning: on a GPU the two epilogue kernels are `triton.autotune`d over CONFIGS (keyed by the power-of-two bucket
of the row count, so a new micro-batch size re-tunes at most once per bucket); under the CPU interpreter (which has
no timer) they run the one configuration of the module attributes BLOCK_N / BLOCK_V, which tests shrink (the GPU
too with AUTOTUNE = False: the kernel tests, which need one compile per flag combination, not a tuning run).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from .logprob import merge_partials, triton_chunk_columns

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

# the interpreter's one configuration (tests shrink them to exercise multi-tile paths at small shapes)
BLOCK_N = 16
BLOCK_V = 128
SPLIT = 2048  # columns of a chunk one stats program reduces (its partials are merged with the others at the end)
N_STATS = 4   # m, s, u, t

# GPU configurations (BLOCK_N rows x BLOCK_V columns per step, warps, stages): memory-bound passes over fp32 tiles;
# few, since every one is compiled for every flag combination the first time a process launches it
CONFIGS = [(4, 1024, 8, 2), (8, 512, 8, 3), (16, 256, 4, 2), (32, 128, 4, 2)]
AUTOTUNE = True  # False: the GPU runs BLOCK_N / BLOCK_V too (the kernel tests: one compile per flag combination)


def _configs():
    return [triton.Config({"BLOCK_N": n, "BLOCK_V": v}, num_warps=w, num_stages=s) for n, v, w, s in CONFIGS]


@triton.jit
def _stats_kernel(x_ptr, tgt_ptr, part_ptr, N, C, stride_x, c0, slot0, plane, temperature, ROWS_BUCKET,
                  SPLIT: tl.constexpr, WITH_ENT: tl.constexpr, SCALED: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_V: tl.constexpr):
    """Program (i, j): rows [i*BLOCK_N, ...) of the fp32 chunk x [N, C], columns [j*SPLIT, (j+1)*SPLIT): writes their
    (m, s, u, t) at slot slot0 + j of part [4, slots, N] (u only WITH_ENT). ROWS_BUCKET: the autotuning key only."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    tgt = tl.load(tgt_ptr + rows, mask=row_mask, other=-1) - c0  # the target's column in this chunk (or outside)
    m = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    s = tl.zeros([BLOCK_N], dtype=tl.float32)
    u = tl.zeros([BLOCK_N], dtype=tl.float32)
    t = tl.zeros([BLOCK_N], dtype=tl.float32)
    lo = pid_s * SPLIT
    hi = tl.minimum(lo + SPLIT, C)
    base = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    for v0 in range(lo, hi, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        mask = row_mask[:, None] & (cols < hi)[None, :]
        x = tl.load(base + cols[None, :], mask=mask, other=float("-inf"))
        if SCALED:
            x = x / temperature
        t += tl.sum(tl.where((cols[None, :] == tgt[:, None]) & mask, x, 0.0), axis=1)
        new_m = tl.maximum(m, tl.max(x, axis=1))
        ref = tl.where(new_m == float("-inf"), 0.0, new_m)  # rows outside N: nothing seen, keep the sums at 0
        alpha = tl.exp(m - ref)
        d = tl.where(mask, x - ref[:, None], 0.0)
        e = tl.where(mask, tl.exp(d), 0.0)
        if WITH_ENT:  # u is relative to the running max: re-base it on the new one
            u = alpha * (u + tl.where(s > 0, m - ref, 0.0) * s) + tl.sum(e * d, axis=1)
        s = s * alpha + tl.sum(e, axis=1)
        m = new_m
    out = (slot0 + pid_s) * N + rows
    tl.store(part_ptr + out, m, mask=row_mask)
    tl.store(part_ptr + plane + out, s, mask=row_mask)
    tl.store(part_ptr + 3 * plane + out, t, mask=row_mask)
    if WITH_ENT:
        tl.store(part_ptr + 2 * plane + out, u, mask=row_mask)


@triton.jit
def _grad_kernel(x_ptr, tgt_ptr, logz_ptr, ent_ptr, glp_ptr, gent_ptr, g_ptr, glo_ptr, N, C, stride_x, stride_g, c0,
                 temperature, ROWS_BUCKET, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr, SCALED: tl.constexpr,
                 HI_LO: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """d loss / d logits of the fp32 chunk x [N, C] (columns c0 + ...) into g (input dtype; HI_LO: also its rounding
    error into glo)."""
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = row_mask[:, None] & (cols < C)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if SCALED:
        x = x / temperature
    logp = x - tl.load(logz_ptr + rows, mask=row_mask, other=0.0)[:, None]
    p = tl.exp(logp)
    grad = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    if HAS_GENT:  # d entropy / d l_v = -p_v (log p_v + H)
        ent = tl.load(ent_ptr + rows, mask=row_mask, other=0.0)
        gent = tl.load(gent_ptr + rows, mask=row_mask, other=0.0)
        grad = -gent[:, None] * p * (logp + ent[:, None])
    if HAS_GLP:  # d logprob / d l_v = 1[v = target] - p_v
        tgt = tl.load(tgt_ptr + rows, mask=row_mask, other=-1) - c0
        glp = tl.load(glp_ptr + rows, mask=row_mask, other=0.0)
        grad += glp[:, None] * ((cols[None, :] == tgt[:, None]).to(tl.float32) - p)
    if SCALED:
        grad = grad / temperature
    offs = rows.to(tl.int64)[:, None] * stride_g + cols[None, :]
    hi = grad.to(g_ptr.dtype.element_ty)
    tl.store(g_ptr + offs, hi, mask=mask)
    if HI_LO:  # the rounding error of the half-precision tile, itself in half precision: hi + lo = grad to ~2^-16
        tl.store(glo_ptr + offs, (grad - hi.to(tl.float32)).to(glo_ptr.dtype.element_ty), mask=mask)


def autotuned(kernel):
    """`kernel` autotuned over CONFIGS by the rows' bucket (None under the interpreter: no timer there)."""
    return None if INTERPRETED else triton.autotune(configs=_configs(), key=["ROWS_BUCKET"])(kernel)


_stats_tuned = autotuned(_stats_kernel)
_grad_tuned = autotuned(_grad_kernel)


def launch(kernel, tuned, blocks: tuple, grid_cols, n: int, *args, **constexprs):
    """Launch an epilogue kernel over n rows: `tuned` (its autotuned wrapper) on a GPU, `kernel` with `blocks` =
    (BLOCK_N, BLOCK_V), the calling module's one configuration, under the interpreter (or AUTOTUNE False).
    grid_cols: programs along the columns, or a function of BLOCK_V giving them. The rows' power-of-two bucket is
    the last argument (the key)."""
    bucket = triton.next_power_of_2(max(n, 1))
    if INTERPRETED or not AUTOTUNE:
        block_n, block_v = blocks
        cols = grid_cols(block_v) if callable(grid_cols) else grid_cols
        kernel[(triton.cdiv(n, block_n), cols)](*args, bucket, BLOCK_N=block_n, BLOCK_V=block_v, **constexprs)
    else:
        tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),
                            grid_cols(meta["BLOCK_V"]) if callable(grid_cols) else grid_cols)](*args, bucket,
                                                                                                **constexprs)


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b accumulated AND returned in fp32: cuBLAS with half-precision inputs and an fp32 output on CUDA
    (``out_dtype``; what megatron's wgrad_gemm_accum_fp32 computes), else on fp32 copies (exact products of
    half-precision values, so the CPU interpreter gives the same numbers up to summation order)."""
    if a.dtype == torch.float32:
        return a @ b
    if a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):  # a torch without mm(out_dtype=) for these dtypes
            pass
    return a.float() @ b.float()


def check_inputs(who: str, *tensors):
    if tensors[0].dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{who}[triton]: unsupported dtype {tensors[0].dtype}")
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError(f"{who}[triton]: hidden rows and weight need a contiguous last dimension")


def chunks_of(v: int, cols: int) -> list:
    """[(c0, c)]: the vocabulary chunks of a shard of v rows."""
    return [(c0, min(cols, v - c0)) for c0 in range(0, v, cols)]


def kept_chunks(chunks: list, rows: int, saved_bytes: Optional[int]) -> int:
    """How many of the last chunks the forward keeps for the backward: as many fp32 [rows, C] chunks as saved_bytes
    holds (None: one, the buffer the backward's first chunk would need anyway)."""
    if not chunks:
        return 0
    if saved_bytes is None:
        return 1
    return max(0, min(len(chunks), int(saved_bytes) // max(1, rows * chunks[0][1] * 4)))


def chunk_pass(rows: torch.Tensor, weight: torch.Tensor, chunks: list, split: int, keep: int, kept: dict):
    """The forward's chunk loop, shared with the divergence head: yields (c0, c, slot, splits, logits) per chunk, the
    fp32 logits of `rows` against the chunk's weight rows (one GEMM) and the first partials slot of its `splits`
    column splits of `split` columns; the last `keep` chunks' logits go into `kept` ({c0: logits})."""
    slot = 0
    for i, (c0, c) in enumerate(chunks):
        logits = mm_fp32(rows, weight[c0:c0 + c].t())
        splits = triton.cdiv(c, split)
        yield c0, c, slot, splits, logits
        if i >= len(chunks) - keep:
            kept[c0] = logits
        slot += splits


def slots_of(chunks: list, split: int) -> int:
    """Partials slots of the chunks' column splits (at least one)."""
    return max(1, sum(triton.cdiv(c, split) for _, c in chunks))


def local_partials(hidden: torch.Tensor, weight: torch.Tensor, targets_local: torch.Tensor, with_entropy: bool,
                   temperature: float = 1.0, chunk_size: Optional[int] = None, keep: int = 0):
    """Per-row partials (m, s, u, t, found) over this shard of logits / temperature, as logprob._local_partials_torch,
    and {c0: fp32 logits} of the last `keep` chunks (for the backward)."""
    check_inputs("fused_logprobs", hidden, weight)
    n = hidden.shape[0]
    v = weight.shape[0]
    chunks = chunks_of(v, chunk_size or triton_chunk_columns(n, v))
    parts = torch.empty(N_STATS, slots_of(chunks, SPLIT), n, device=hidden.device, dtype=torch.float32)
    if not with_entropy:
        parts[2].zero_()
    tg = targets_local.contiguous()
    kept = {}
    for c0, c, slot, splits, logits in chunk_pass(hidden, weight, chunks, SPLIT, keep, kept):
        if n:
            launch(_stats_kernel, _stats_tuned, (BLOCK_N, BLOCK_V), splits, n, logits, tg, parts, n, c,
                   logits.stride(0), c0, slot, parts.stride(0), float(temperature), SPLIT=SPLIT,
                   WITH_ENT=with_entropy, SCALED=float(temperature) != 1.0)
    m, s, u, t = merge_partials(*parts[:, :slots_of(chunks, SPLIT)])
    return m, s, u, t, (targets_local >= 0) & (targets_local < v), kept


def backward(hidden, weight, targets_local, log_z, entropy, g_lp, g_ent, need_h, need_w, temperature: float = 1.0,
             main_grad=None, chunk_size: Optional[int] = None, kept: Optional[dict] = None):
    """(grad_hidden fp32, grad_weight). With ``main_grad`` (fp32 [V_local, H], logprob._fp32_main_grad) each chunk's
    weight gradient is computed with fp32 accumulation and output and ADDED to it; grad_weight is then None.
    `kept`: {c0: fp32 logits chunk} from the forward (consumed)."""
    check_inputs("fused_logprobs", hidden, weight)
    n, hd = hidden.shape
    v = weight.shape[0]
    kept = kept if kept is not None else {}
    grad_h = torch.zeros(n, hd, device=hidden.device, dtype=torch.float32) if need_h else None
    grad_w = torch.empty_like(weight) if need_w and main_grad is None else None
    if n == 0:
        if grad_w is not None:
            grad_w.zero_()
        return grad_h, grad_w
    hi_lo = main_grad is not None and need_w and hidden.dtype != torch.float32
    dummy = log_z  # any float32 tensor for unused pointers
    tg = targets_local.contiguous()
    for c0, c in reversed(chunks_of(v, chunk_size or triton_chunk_columns(n, v))):
        w_c = weight[c0:c0 + c]
        logits = kept.pop(c0, None)
        if logits is None:
            logits = mm_fp32(hidden, w_c.t())
        g = torch.empty(n, c, device=hidden.device, dtype=hidden.dtype)
        g_lo = torch.empty_like(g) if hi_lo else g
        launch(_grad_kernel, _grad_tuned, (BLOCK_N, BLOCK_V), lambda bv: triton.cdiv(c, bv), n, logits, tg,
               log_z, entropy if g_ent is not None else dummy, g_lp if g_lp is not None else dummy,
               g_ent if g_ent is not None else dummy, g, g_lo, n, c, logits.stride(0), g.stride(0), c0,
               float(temperature), HAS_GLP=g_lp is not None, HAS_GENT=g_ent is not None,
               SCALED=float(temperature) != 1.0, HI_LO=hi_lo)
        del logits
        if need_h:
            grad_h += mm_fp32(g, w_c)
        if need_w and main_grad is not None:
            main_grad[c0:c0 + c] += mm_fp32(g.t(), hidden)
            if hi_lo:
                main_grad[c0:c0 + c] += mm_fp32(g_lo.t(), hidden)
        elif need_w:
            torch.mm(g.t(), hidden, out=grad_w[c0:c0 + c])
    return grad_h, grad_w
