"""Fork attention alone (scoring forward): ours vs the naive scorer's per-sequence attention, dense-mask SDPA, its
torch.compile, and FlexAttention with the same fork block mask. Layout: G groups, each a shared prefix then B branches
that never see each other.

The SDPA peers get what SDPA's fused kernels need: 4-D [batch, heads, tokens, head_dim] tensors, contiguous, the
key/value heads expanded to the query heads (prepared once, outside the timed call), so on a GPU they run a fused
kernel (flash / memory-efficient), not the math fallback. The per-sequence peer is the naive scorer's attention as
one batched call: every branch its own causal sequence [prefix || branch] ([G·B, heads, P + L, head_dim]). Its FLOPs
(`per_sequence_pairs`) are the case's `peer_flops`: the ratio to ours is the most the fork layout can save."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from opid_mega.kernels import build_fork_metadata, fork_attention, fork_attention_mask, fork_attention_reference

from .core import Case, Method, Preset, interpreter_enabled, max_abs
from .roofline import fork_attention_steps

INTERPRETER_MAX_TOKENS = 256  # the Triton interpreter runs every program instance in Python


def fork_layout(groups: int, prefix: int, branches: int, branch_tokens: int, device):
    """cu_seqlens [G+1] int32 and branch_ids [N] int32 of the fork layout."""
    per = prefix + branches * branch_tokens
    cu = torch.arange(groups + 1, dtype=torch.int32) * per
    one = torch.cat([torch.zeros(prefix, dtype=torch.int32)]
                    + [torch.full((branch_tokens,), b + 1, dtype=torch.int32) for b in range(branches)])
    return cu.to(device), one.repeat(groups).to(device)


def attended_pairs(groups: int, prefix: int, branches: int, branch_tokens: int) -> int:
    """(query, key) pairs the fork rule allows: each prefix causally once, each branch over prefix + itself."""
    p, L = prefix, branch_tokens
    return groups * (p * (p + 1) // 2 + branches * (L * p + L * (L + 1) // 2))


def per_sequence_pairs(groups: int, prefix: int, branches: int, branch_tokens: int) -> int:
    """(query, key) pairs of the naive scorer's attention: each branch a causal sequence of P + L tokens."""
    n = prefix + branch_tokens
    return groups * branches * n * (n + 1) // 2


def _reference(q, k, v, cu, bid):
    """float64 reference, one group at a time (groups never see each other)."""
    outs = []
    for g in range(cu.numel() - 1):
        s, e = int(cu[g]), int(cu[g + 1])
        outs.append(fork_attention_reference(q[s:e], k[s:e], v[s:e], cu[:2] * 0 + torch.tensor([0, e - s],
                                             device=cu.device, dtype=cu.dtype), bid[s:e]))
    return torch.cat(outs)


def _flex(q, k, v, cu, bid, compiled: bool):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    n = q.shape[0]
    group = torch.searchsorted(cu.long()[1:], torch.arange(n, device=q.device), right=True)
    bidl = bid.long()

    def mask_mod(b, h, qi, ki):
        return (group[qi] == group[ki]) & (ki <= qi) & ((bidl[ki] == 0) | (bidl[ki] == bidl[qi]))

    block_mask = create_block_mask(mask_mod, None, None, n, n, device=q.device.type)
    fn = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
    rep = q.shape[1] // k.shape[1]

    def call():
        out = fn(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], block_mask=block_mask,
                 enable_gqa=rep > 1)
        return out[0].transpose(0, 1)
    return call


def fork_attention_cases(preset: Preset, device: torch.device, compile_peers: bool = True) -> list:
    return [_case(preset, dtype_name, device, compile_peers) for dtype_name in preset.dtypes]


def _case(preset: Preset, dtype_name: str, device, compile_peers) -> Case:
    groups, prefix, branches, branch_tokens = preset.fork
    hq, hkv, d = preset.heads_rank, preset.kv_heads_rank, preset.head_dim
    cu, bid = fork_layout(groups, prefix, branches, branch_tokens, device)
    n = bid.numel()
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, d, generator=g).to(dtype).to(device) for h in (hq, hkv, hkv))
    ref = _reference(q, k, v, cu, bid)
    meta = build_fork_metadata(cu, bid)
    scale = 1.0 / math.sqrt(d)
    rep = hq // hkv

    # the SDPA peers' inputs, prepared once: 4-D, contiguous, key/value heads expanded to the query heads
    q4, k4, v4 = (x.repeat_interleave(r, 1).transpose(0, 1).unsqueeze(0).contiguous()
                  for x, r in ((q, 1), (k, rep), (v, rep)))
    mask = fork_attention_mask(cu, bid)
    per = prefix + branches * branch_tokens
    seq_rows = torch.stack([torch.cat([torch.arange(g * per, g * per + prefix),
                                       torch.arange(g * per + prefix + b * branch_tokens,
                                                    g * per + prefix + (b + 1) * branch_tokens)])
                            for g in range(groups) for b in range(branches)]).to(q.device)  # [G*B, P+L]
    qs, ks, vs = (x[0].transpose(0, 1)[seq_rows].transpose(1, 2).contiguous() for x in (q4, k4, v4))

    def dense():
        out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=scale)
        return out[0].transpose(0, 1)

    def per_sequence():
        """The naive scorer's attention: every branch its own causal sequence [prefix || branch], all in one batched
        SDPA call; each branch re-reads (and recomputes) the prefix; the prefix rows come from the first branch's."""
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(1, 2)  # [G*B, P+L, ..]
        out = torch.empty_like(q)
        out[seq_rows[:, prefix:].reshape(-1)] = o[:, prefix:].reshape(-1, hq, d)
        first = torch.arange(0, groups * branches, branches, device=q.device)  # each group's first branch
        out[seq_rows[first, :prefix].reshape(-1)] = o[first, :prefix].reshape(-1, hq, d)
        return out

    rows = []
    if device.type == "cuda":
        rows.append(Method("fork_attention", "ours", "Triton",
                           lambda: fork_attention(q, k, v, cu, bid, backend="triton", meta=meta)))
    rows.append(Method("fork_attention", "ours", "torch path (SDPA per segment)",
                       lambda: fork_attention(q, k, v, cu, bid, backend="torch", meta=meta)))
    if device.type != "cuda":
        skip = None
        if not interpreter_enabled():
            skip = "CPU without TRITON_INTERPRET=1 at start: Triton cannot run"
        elif n > INTERPRETER_MAX_TOKENS:
            skip = f"Triton interpreter too slow at N = {n} tokens (runs up to {INTERPRETER_MAX_TOKENS}: preset tiny)"
        rows.append(Method("fork_attention", "ours", "Triton interpreter",
                           None if skip else lambda: fork_attention(q, k, v, cu, bid, backend="triton", meta=meta),
                           skip))
    rows.append(Method("per-sequence causal SDPA (naive scorer: prefix per branch)", "peer", "eager",
                       per_sequence))
    rows.append(Method("SDPA with the dense [N, N] mask", "peer", "eager", dense))
    if compile_peers:
        rows.append(Method("torch.compile(dense SDPA)", "peer", "inductor", torch.compile(dense, dynamic=False)))
        rows.append(Method("FlexAttention, fork block mask", "peer", "inductor", _flex(q, k, v, cu, bid, True)))
    else:
        rows.append(Method("torch.compile(dense SDPA)", "peer", "inductor", skipped="--no-compile"))
        rows.append(Method("FlexAttention, fork block mask", "peer", "eager (unfused reference path)",
                           _flex(q, k, v, cu, bid, False)))
    pairs = attended_pairs(groups, prefix, branches, branch_tokens)
    shape = {"N": n, "groups": groups, "prefix": prefix, "branches": branches, "branch_tokens": branch_tokens,
             "heads": hq, "kv_heads": hkv, "head_dim": d, "attended_pairs": pairs}

    def roofline():
        block_m, block_n = kernel_tiles()
        return ({"BLOCK_M": block_m, "BLOCK_N": block_n},
                fork_attention_steps(meta.cu_seqlens.tolist(), meta.prefix_end.tolist(), meta.seg_start.tolist(), hq,
                                     hkv, d, q.element_size(), block_m, block_n))
    peer_flops = 4 * per_sequence_pairs(groups, prefix, branches, branch_tokens) * hq * d
    return Case(f"fwd {dtype_name}", shape, dtype_name, 4 * pairs * hq * d, rows,
                lambda out: {"out": max_abs(out, ref)}, roofline=roofline,
                extra={"per_sequence_flops": peer_flops,
                       "flop_ratio_per_sequence": round(peer_flops / (4 * pairs * hq * d), 4)})


def kernel_tiles() -> tuple:
    """(BLOCK_M, BLOCK_N) the Triton fork-attention kernel ran with last (autotuned on a GPU)."""
    from opid_mega.kernels import fork_attention_triton

    return fork_attention_triton.tiles()


OPS = {
    "fork_attention": ("fork attention alone: shared prefix once, branches apart (scoring forward)",
                       fork_attention_cases),
}
