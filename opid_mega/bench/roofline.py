"""Roofline models of our kernels' chosen configurations: every launch (a GEMM, an epilogue pass, an attention
kernel) as (FLOPs, bytes moved to and from device memory), and the time the launches predict one after another at
this machine's measured matmul rate and memory bandwidth: per launch the larger of FLOPs / rate and
bytes / bandwidth, summed (`predict`).

What is counted, per kernel (N rows, H hidden, V vocabulary of this rank, e bytes per input element, C columns per
chunk as `kernels.logprob.triton_chunk_columns` chooses them):
  log-prob head forward, per chunk: the GEMM (2·N·H·C FLOPs; reads N·H·e of hidden rows and C·H·e of weight rows,
      writes 4·N·C of fp32 logits) and the statistics epilogue (reads the 4·N·C); the weight is read once in all.
  backward, per chunk (last first): the GEMM again unless the forward kept the chunk, the gradient epilogue (reads
      4·N·C, writes e·N·C of d logits), grad_hidden (2·N·H·C; reads the d logits and the weight rows, writes
      fp32 N·H, then reads it and the running sum and writes the sum: 12·N·H) and the weight gradient (2·N·H·C;
      reads the d logits and the hidden rows, writes C·H·e).
  divergence head: the same with both contexts stacked (2N rows) in the forward GEMM and epilogue, the top-k pass
      (`torch.topk`, reads the skill half, 4·N·C), and in the backward both contexts recomputed when a KL needs a
      gradient.
  fork attention: per (query block, head) program the tiles it visits (kernels/fork_attention_triton.py: the
      prefix's key blocks up to the block's last row, then its own run's), 4·BLOCK_M·BLOCK_N·D FLOPs each (QK^T and
      PV, masked elements included); bytes: q, k, v read and the output written once (the key/value tiles that
      several query blocks share are counted once: L2 serves the repeats).
The epilogues' arithmetic is not matmul work and is left out of the FLOPs (they are bound by their bytes).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    """One launch, or `count` identical ones."""
    name: str
    flops: float
    bytes: float
    count: int = 1


def predict(steps: list, rate: float, bandwidth: float) -> dict:
    """The launches' FLOPs, bytes and predicted time at `rate` FLOP/s and `bandwidth` bytes/s; `limit` says which of
    compute or memory takes the larger share of that time. steps: [{name, count, flops, bytes, bound}] merged by
    name."""
    merged: dict = {}
    compute_s = memory_s = 0.0
    for st in steps:
        c, m = st.flops / rate * st.count, st.bytes / bandwidth * st.count
        row = merged.setdefault(st.name, {"name": st.name, "count": 0, "flops": 0.0, "bytes": 0.0, "seconds": 0.0})
        row["count"] += st.count
        row["flops"] += st.flops * st.count
        row["bytes"] += st.bytes * st.count
        row["seconds"] += max(c, m)
        if c >= m:
            compute_s += c
        else:
            memory_s += m
    total = compute_s + memory_s
    return {"flops": sum(r["flops"] for r in merged.values()), "bytes": sum(r["bytes"] for r in merged.values()),
            "bound_s": total, "compute_s": compute_s, "memory_s": memory_s,
            "limit": "compute" if compute_s >= memory_s else "memory", "steps": list(merged.values())}


def _chunks(v: int, cols: int) -> list:
    return [min(cols, v - c0) for c0 in range(0, v, cols)]


def logprob_steps(n: int, h: int, v: int, elt: int, cols: int, backward: bool, kept: int = 1) -> list:
    """The Triton log-prob head over n rows, chunks of `cols` columns; with the backward (the last `kept` chunks
    reused from the forward)."""
    steps = []
    widths = _chunks(v, cols)
    for c in widths:
        steps += [Step("logits GEMM", 2 * n * h * c, n * h * elt + c * h * elt + 4 * n * c),
                  Step("statistics epilogue", 0, 4 * n * c)]
    if backward:
        for i, c in enumerate(reversed(widths)):
            if i >= kept:
                steps.append(Step("logits GEMM (recomputed)", 2 * n * h * c, n * h * elt + c * h * elt + 4 * n * c))
            steps += [Step("gradient epilogue", 0, 4 * n * c + elt * n * c),
                      Step("grad_hidden GEMM", 2 * n * h * c, elt * n * c + c * h * elt + 4 * n * h + 12 * n * h),
                      Step("grad_weight GEMM", 2 * n * h * c, elt * n * c + n * h * elt + c * h * elt)]
    return steps


def divergence_steps(n: int, h: int, v: int, elt: int, cols: int, topk: int, backward: bool, kept: int = 1,
                     kl_grads: bool = True) -> list:
    """The Triton divergence head: both contexts (2n rows) per chunk of `cols` columns; top-k; the backward through
    the original rows (both contexts recomputed when a KL has a gradient)."""
    steps = []
    widths = _chunks(v, cols)
    for c in widths:
        steps += [Step("logits GEMM (both contexts)", 2 * 2 * n * h * c, 2 * n * h * elt + c * h * elt + 8 * n * c),
                  Step("statistics epilogue", 0, 8 * n * c)]
        if topk:
            steps.append(Step("top-k per chunk", 0, 4 * n * c))
    if backward:
        rows = 2 * n if kl_grads else n
        for i, c in enumerate(reversed(widths)):
            if i >= kept:
                steps.append(Step("logits GEMM (recomputed)", 2 * rows * h * c,
                                  rows * h * elt + c * h * elt + 4 * rows * c))
            steps += [Step("gradient epilogue", 0, 4 * rows * c + elt * n * c),
                      Step("grad_hidden GEMM", 2 * n * h * c, elt * n * c + c * h * elt + 16 * n * h),
                      Step("grad_weight GEMM", 2 * n * h * c, elt * n * c + n * h * elt + c * h * elt)]
    return steps


def fork_attention_tiles(cu: list, prefix_end: list, seg_start: list, block_m: int, block_n: int) -> int:
    """(query block, key block) tiles the Triton kernel visits over all groups, per head: for each query block
    [m0, q_hi) of a group [g0, g1) with prefix end p, the prefix blocks from g0 up to min(p, q_hi) and its own run's
    blocks from max(seg_start[m0], p) up to q_hi."""
    tiles = 0
    for g0, g1, p in zip(cu[:-1], cu[1:], prefix_end):
        for m0 in range(g0, g1, block_m):
            q_hi = min(m0 + block_m, g1)
            pre_hi = min(p, q_hi)
            own_lo = max(seg_start[m0], p)
            tiles += -(-(pre_hi - g0) // block_n) if pre_hi > g0 else 0
            tiles += -(-(q_hi - own_lo) // block_n) if q_hi > own_lo else 0
    return tiles


def fork_attention_steps(cu: list, prefix_end: list, seg_start: list, heads: int, kv_heads: int, head_dim: int,
                         elt: int, block_m: int, block_n: int) -> list:
    n = cu[-1]
    tiles = fork_attention_tiles(cu, prefix_end, seg_start, block_m, block_n)
    return [Step("fork attention", 4 * block_m * block_n * head_dim * heads * tiles,
                 (2 * n * heads + 2 * n * kv_heads) * head_dim * elt)]
