"""Fused dual-context divergence head: the same response tokens under two contexts, one pass over the vocabulary.

Given hidden rows of the skill context `h_s` and of the original context `h_o` (row i of both = the same response
token), the LM-head weight shard W and the targets y, with logits a = h_s W^T / T (skill) and b = h_o W^T / T
(original), p_s = softmax(a), p_o = softmax(b), compute per row without materialising `[N, V]` logits:

    logp_skill = a_y - lse(a)                 logp_orig = b_y - lse(b)
    kl_skill_orig = KL(p_s || p_o) = sum_v p_s (a_v - b_v) - lse(a) + lse(b)
    kl_orig_skill = KL(p_o || p_s) = sum_v p_o (b_v - a_v) - lse(b) + lse(a)
    (topk > 0) the top-k of p_s: ids, log p_s, log p_o at those ids, and the mass sum_k p_s.

Streaming form: per row and context the running max m, S = sum_v exp(z_v - m), and the KL numerators
A = sum_v exp(a_v - m_s) (a_v - b_v), B = sum_v exp(b_v - m_o) (b_v - a_v). When the max moves from m to m',
S and A (or B) are both multiplied by exp(m - m') (the difference a - b does not depend on m). Then
KL(p_s || p_o) = A / S_s - (M_s + log S_s) + (M_o + log S_o) and symmetrically for the reverse.

Vocabulary parallel: each rank reduces its shard to (m_s, m_o) and (S_s, A, S_o, B, target logits, found); one MAX
all-reduce of the maxima and one SUM all-reduce of the rescaled rest over `tp_group`, as in `logprob.py`. Top-k:
each rank's top-k is all-gathered and merged.

Gradients (the backward works chunk by chunk, recomputing the logits the forward did not keep): the skill side is
stop-gradient (teacher), so `logp_orig`, `kl_skill_orig` and `kl_orig_skill` are differentiable w.r.t. `h_orig` and
the weight THROUGH b ONLY; `logp_skill` and the top-k outputs are not differentiable. With p = p_o, q = p_s,
r_v = log p_v - log q_v:

    d logp_orig / d b_v      = 1[v = y] - p_v
    d KL(q || p) / d b_v     = p_v - q_v
    d KL(p || q) / d b_v     = p_v (r_v - KL(p || q))

then a 1/T factor (logits / T). The hidden-state gradient is all-reduced over TP (replicated input); the weight
gradient stays on its shard. KL values are not clamped: rounding can give -1e-7 for identical contexts.

Backends: "torch" = chunked over the vocabulary, fp32 matmuls and torch ops (CPU path); "triton" = per vocabulary
chunk one GEMM for both contexts (cuBLAS, fp32 output) and autotuned Triton epilogues for the statistics and the
gradient, top-k by `torch.topk` per chunk (dual_context_divergence_triton.py; logprob_triton.py says why).
`divergence_reference` is the float64 full-logits version for tests; `naive_divergence` the un-fused baseline of the
benchmark.

Name trap: `opid_mega.kernels.dual_context_divergence` is the FUNCTION (the package re-exports it); import other
names with `from opid_mega.kernels.dual_context_divergence import ...` (`import ... as mod` gives the function).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ._dispatch import load_triton_module, resolve_backend
from .logprob import DEFAULT_CHUNK, _fp32_main_grad, triton_chunk_columns

OUTPUT_KEYS = ("logp_skill", "logp_orig", "kl_skill_orig", "kl_orig_skill")
TOPK_KEYS = ("topk_ids", "topk_logp_skill", "topk_logp_orig", "topk_mass")
_NAME = "dual_context_divergence"


# ----------------------------------------------------------------------------------------------------------------
# references (full [N, V] logits)
# ----------------------------------------------------------------------------------------------------------------
def _from_log_softmax(ls: torch.Tensor, lo: torch.Tensor, targets_local: torch.Tensor, topk: int, vocab_start: int):
    out = {
        "logp_skill": ls.gather(-1, targets_local.unsqueeze(-1)).squeeze(-1),
        "logp_orig": lo.gather(-1, targets_local.unsqueeze(-1)).squeeze(-1),
        "kl_skill_orig": (ls.exp() * (ls - lo)).sum(-1),
        "kl_orig_skill": (lo.exp() * (lo - ls)).sum(-1),
    }
    if topk > 0:
        vals, idx = ls.topk(topk, dim=-1)
        out["topk_ids"] = idx + vocab_start
        out["topk_logp_skill"] = vals
        out["topk_logp_orig"] = lo.gather(-1, idx)
        out["topk_mass"] = vals.exp().sum(-1)
    return out


def divergence_reference(h_skill: torch.Tensor, h_orig: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         vocab_start: int = 0, topk: int = 0, temperature: float = 1.0) -> dict:
    """float64 full-logits reference (tests), with the kernel's gradients: the skill logits are a stop-gradient
    (h_skill and the weight's use in them); differentiable w.r.t. h_orig and the weight through the original logits.
    Targets must lie in [vocab_start, vocab_start + V)."""
    w = weight.double()
    a = h_skill.detach().double() @ w.detach().t() / temperature
    b = h_orig.double() @ w.t() / temperature
    return _from_log_softmax(torch.log_softmax(a, -1), torch.log_softmax(b, -1), targets.long() - vocab_start, topk,
                             vocab_start)


def naive_divergence(h_skill: torch.Tensor, h_orig: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                     vocab_start: int = 0, topk: int = 0, temperature: float = 1.0) -> dict:
    """The usual un-fused path: two full [N, V] float32 log-softmaxes (benchmark baseline; skill side detached)."""
    a = (h_skill.detach() @ weight.detach().t()).float()
    b = (h_orig @ weight.t()).float()
    if temperature != 1.0:
        a, b = a / temperature, b / temperature
    return _from_log_softmax(torch.log_softmax(a, -1), torch.log_softmax(b, -1), targets.long() - vocab_start, topk,
                             vocab_start)


# ----------------------------------------------------------------------------------------------------------------
# torch path
# ----------------------------------------------------------------------------------------------------------------
def _merge_topk(vals, ids, bvals, new_vals, new_ids, new_bvals, k):
    vals = torch.cat([vals, new_vals], 1)
    ids = torch.cat([ids, new_ids], 1)
    bvals = torch.cat([bvals, new_bvals], 1)
    vals, pos = vals.topk(min(k, vals.shape[1]), dim=1)
    return vals, ids.gather(1, pos), bvals.gather(1, pos)


def _pad_topk(vals, ids, bvals, k):
    """Pad to k columns (value -inf, id -1) so every rank all-gathers the same shape."""
    n, have = vals.shape
    if have < k:
        vals = torch.cat([vals, vals.new_full((n, k - have), float("-inf"))], 1)
        ids = torch.cat([ids, ids.new_full((n, k - have), -1)], 1)
        bvals = torch.cat([bvals, bvals.new_full((n, k - have), float("-inf"))], 1)
    return vals, ids, bvals


def _local_partials_torch(h_skill, h_orig, weight, targets_local, topk, chunk, temperature):
    """Per-row partials over this shard: dict of float32 [N] (m_s, s_s, a_num, m_o, s_o, b_num, t_s, t_o), bool
    `found`, and (topk > 0) the shard's top-k of the skill logits (vals, local ids, orig logits) [N, <=k]."""
    n, v = h_skill.shape[0], weight.shape[0]
    dev = h_skill.device
    hs, ho = h_skill.float(), h_orig.float()
    inf = float("-inf")
    m_s, m_o = torch.full((n,), inf, device=dev), torch.full((n,), inf, device=dev)
    s_s, s_o, a_num, b_num, t_s, t_o = (torch.zeros(n, device=dev) for _ in range(6))
    found = (targets_local >= 0) & (targets_local < v)
    rows = torch.arange(n, device=dev)
    tk_vals = torch.empty(n, 0, device=dev)
    tk_ids = torch.empty(n, 0, dtype=torch.long, device=dev)
    tk_b = torch.empty(n, 0, device=dev)
    for start in range(0, v, chunk):
        end = min(start + chunk, v)
        w32 = weight[start:end].float()
        a = hs @ w32.t()  # [N, C] skill logits
        b = ho @ w32.t()  # [N, C] original logits
        if temperature != 1.0:
            a.div_(temperature)
            b.div_(temperature)
        sel = found & (targets_local >= start) & (targets_local < end)
        idx = (targets_local - start).clamp(0, end - start - 1)
        t_s = torch.where(sel, a[rows, idx], t_s)
        t_o = torch.where(sel, b[rows, idx], t_o)
        if topk > 0:
            kk = min(topk, end - start)
            cv, ci = a.topk(kk, dim=1)
            tk_vals, tk_ids, tk_b = _merge_topk(tk_vals, tk_ids, tk_b, cv, ci + start, b.gather(1, ci), topk)
        new_ms = torch.maximum(m_s, a.max(dim=1).values)
        new_mo = torch.maximum(m_o, b.max(dim=1).values)
        alpha_s, alpha_o = torch.exp(m_s - new_ms), torch.exp(m_o - new_mo)  # 0 on the first chunk
        diff = a - b  # a - b: three [N, chunk] buffers in all (a, b, diff)
        e = a.sub_(new_ms.unsqueeze(1)).exp_()  # exp(a - m_s), in place
        s_s = s_s * alpha_s + e.sum(dim=1)
        a_num = a_num * alpha_s + e.mul_(diff).sum(dim=1)
        e = b.sub_(new_mo.unsqueeze(1)).exp_()
        s_o = s_o * alpha_o + e.sum(dim=1)
        b_num = b_num * alpha_o - e.mul_(diff).sum(dim=1)
        m_s, m_o = new_ms, new_mo
        del a, b, e, diff
    return {"m_s": m_s, "s_s": s_s, "a_num": a_num, "m_o": m_o, "s_o": s_o, "b_num": b_num, "t_s": t_s, "t_o": t_o,
            "found": found, "topk": (tk_vals, tk_ids, tk_b) if topk > 0 else None}


def combine_partials(p: dict, tp_group=None, topk: int = 0, vocab_start: int = 0) -> dict:
    """Merge per-rank partials over `tp_group` (None: one shard). Returns the outputs plus lse_s / lse_o."""
    m_s, m_o = p["m_s"], p["m_o"]
    s_s, a_num, s_o, b_num, t_s, t_o = p["s_s"], p["a_num"], p["s_o"], p["b_num"], p["t_s"], p["t_o"]
    multi = tp_group is not None and dist.get_world_size(tp_group) > 1
    if multi:
        big = torch.stack([m_s, m_o])
        dist.all_reduce(big, op=dist.ReduceOp.MAX, group=tp_group)
        al_s, al_o = torch.exp(m_s - big[0]), torch.exp(m_o - big[1])  # 0 on a rank whose shard is empty
        stacked = torch.stack([s_s * al_s, a_num * al_s, s_o * al_o, b_num * al_o, t_s, t_o, p["found"].float()])
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=tp_group)
        s_s, a_num, s_o, b_num, t_s, t_o, found_count = stacked.unbind(0)
        m_s, m_o = big[0], big[1]
        bad = found_count.round() != 1
    else:
        bad = ~p["found"]
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"{_NAME}: target id of row {i} is outside the vocabulary covered by the shard(s)")
    log_ss, log_so = torch.log(s_s), torch.log(s_o)
    lse_s, lse_o = m_s + log_ss, m_o + log_so
    d = (m_o - m_s) + (log_so - log_ss)  # lse_o - lse_s, from the exact maxima
    out = {"logp_skill": t_s - lse_s, "logp_orig": t_o - lse_o,
           "kl_skill_orig": a_num / s_s + d, "kl_orig_skill": b_num / s_o - d, "lse_s": lse_s, "lse_o": lse_o}
    if topk > 0:
        vals, ids, bvals = _pad_topk(*p["topk"], topk)
        ids = torch.where(ids >= 0, ids + vocab_start, ids)
        if multi:
            world = dist.get_world_size(tp_group)
            gathered = []
            for x in (vals, ids, bvals):
                parts = [torch.empty_like(x) for _ in range(world)]
                dist.all_gather(parts, x.contiguous(), group=tp_group)
                gathered.append(torch.cat(parts, 1))
            vals, ids, bvals = gathered
            vals, pos = vals.topk(topk, dim=1)
            ids, bvals = ids.gather(1, pos), bvals.gather(1, pos)
        if bool(torch.isinf(vals).any()):
            raise ValueError(f"{_NAME}: topk={topk} is larger than the vocabulary")
        lps = vals - lse_s.unsqueeze(1)
        out.update(topk_ids=ids, topk_logp_skill=lps, topk_logp_orig=bvals - lse_o.unsqueeze(1),
                   topk_mass=lps.exp().sum(1))
    return out


def grad_logits_orig(a: Optional[torch.Tensor], b: torch.Tensor, start: int, targets_local, lse_s, lse_o, kl_os,
                     g_lo, g_kf, g_kr) -> torch.Tensor:
    """In place on b: the chunk's d loss / d b (before the 1/T factor); `a` (skill logits) only when a KL has a
    gradient (it is overwritten)."""
    lo = b.sub_(lse_o.unsqueeze(1))  # log p_o
    po = torch.exp(lo)
    if g_kr is not None or g_kf is not None:
        ls = a.sub_(lse_s.unsqueeze(1))  # log p_s
    if g_kr is not None:  # p_o (log p_o - log p_s - KL(p_o || p_s))
        grad = lo.sub_(ls).sub_(kl_os.unsqueeze(1)).mul_(po).mul_(g_kr.unsqueeze(1))
    else:
        grad = torch.zeros_like(po)
    if g_kf is not None:  # p_o - p_s
        grad.addcmul_(po.sub(ls.exp_()), g_kf.unsqueeze(1))
    if g_lo is not None:  # 1[v = y] - p_o
        grad.addcmul_(po, g_lo.unsqueeze(1), value=-1.0)
        c = grad.shape[1]
        sel = (targets_local >= start) & (targets_local < start + c)
        rows = sel.nonzero().squeeze(1)
        if rows.numel():
            grad[rows, targets_local[rows] - start] += g_lo[rows]
    return grad


def _backward_torch(h_skill, h_orig, weight, targets_local, lse_s, lse_o, kl_os, g_lo, g_kf, g_kr, chunk, need_h,
                    need_w, temperature, main_grad=None):
    n, v = h_orig.shape[0], weight.shape[0]
    need_a = g_kf is not None or g_kr is not None
    hs, ho = h_skill.float(), h_orig.float()
    grad_h = torch.zeros(n, h_orig.shape[1], device=h_orig.device) if need_h else None
    grad_w = torch.empty_like(weight) if need_w and main_grad is None else None
    for start in range(0, v, chunk):
        end = min(start + chunk, v)
        w32 = weight[start:end].float()
        a = hs @ w32.t() if need_a else None
        b = ho @ w32.t()
        if temperature != 1.0:
            b.div_(temperature)
            if a is not None:
                a.div_(temperature)
        grad = grad_logits_orig(a, b, start, targets_local, lse_s, lse_o, kl_os, g_lo, g_kf, g_kr)
        if temperature != 1.0:
            grad.div_(temperature)
        if need_h:
            grad_h.addmm_(grad, w32)
        if need_w and main_grad is not None:  # fp32 accumulation into megatron's main_grad (logprob._fp32_main_grad)
            main_grad[start:end].addmm_(grad.t(), ho)
        elif need_w:
            if weight.dtype == torch.float32:
                torch.mm(grad.t(), ho, out=grad_w[start:end])
            else:
                grad_w[start:end] = (grad.t() @ ho).to(weight.dtype)
        del a, b, grad
    return grad_h, grad_w


# ----------------------------------------------------------------------------------------------------------------
# autograd
# ----------------------------------------------------------------------------------------------------------------
class _DualDivergence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_skill, h_orig, weight, targets, vocab_start, tp_group, topk, backend, chunk, reduce_grad,
                temperature, main_grad, saved_bytes):
        targets_local = targets - vocab_start
        if weight.shape[0] == 0:  # this rank's shard is all vocabulary padding
            backend = "torch"
        ctx.kept = {}
        if backend == "triton":
            tri = load_triton_module("dual_context_divergence_triton", h_orig)
            keep = 0
            if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
                rows = 2 * h_orig.shape[0]
                chunks = tri.chunks_of(weight.shape[0], chunk or triton_chunk_columns(rows, weight.shape[0]))
                keep = tri.kept_chunks(chunks, rows, saved_bytes)
            parts, ctx.kept = tri.local_partials(h_skill, h_orig, weight, targets_local, topk, temperature, chunk,
                                                 keep)
        else:
            parts = _local_partials_torch(h_skill, h_orig, weight, targets_local, topk, chunk or DEFAULT_CHUNK,
                                          temperature)
        out = combine_partials(parts, tp_group, topk, vocab_start)
        ctx.save_for_backward(h_skill, h_orig, weight, targets_local, out["lse_s"], out["lse_o"], out["kl_orig_skill"])
        ctx.tp_group, ctx.backend, ctx.chunk, ctx.reduce_grad, ctx.temperature = (tp_group, backend, chunk,
                                                                                   reduce_grad, temperature)
        ctx.main_grad = main_grad
        ctx.set_materialize_grads(False)
        n = h_orig.shape[0]
        if topk > 0:
            tops = [out[k] for k in TOPK_KEYS]
        else:
            tops = [torch.empty(n, 0, dtype=torch.long, device=h_orig.device)] + \
                   [torch.empty(n, 0, device=h_orig.device) for _ in range(2)] + [torch.zeros(n, device=h_orig.device)]
        ctx.mark_non_differentiable(out["logp_skill"], *tops)
        return (out["logp_skill"], out["logp_orig"], out["kl_skill_orig"], out["kl_orig_skill"], *tops)

    @staticmethod
    def backward(ctx, _g_ls, g_lo, g_kf, g_kr, *_g_top):
        h_skill, h_orig, weight, targets_local, lse_s, lse_o, kl_os = ctx.saved_tensors
        kept, ctx.kept = ctx.kept, {}
        need_h, need_w = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        none = (None,) * 13
        if (g_lo is None and g_kf is None and g_kr is None) or not (need_h or need_w):
            return none
        g_lo, g_kf, g_kr = (g.float().contiguous() if g is not None else None for g in (g_lo, g_kf, g_kr))
        main = ctx.main_grad if need_w else None
        if ctx.backend == "triton":
            tri = load_triton_module("dual_context_divergence_triton", h_orig)
            grad_h, grad_w = tri.backward(h_skill, h_orig, weight, targets_local, lse_s, lse_o, kl_os, g_lo, g_kf,
                                          g_kr, need_h, need_w, ctx.temperature, main_grad=main, chunk_size=ctx.chunk,
                                          kept=kept)
        else:
            grad_h, grad_w = _backward_torch(h_skill, h_orig, weight, targets_local, lse_s, lse_o, kl_os, g_lo, g_kf,
                                             g_kr, ctx.chunk or DEFAULT_CHUNK, need_h, need_w, ctx.temperature,
                                             main_grad=main)
        if main is not None:  # added to main_grad in fp32; autograd's share is zero
            grad_w = torch.zeros_like(weight)
        if grad_h is not None:
            if ctx.reduce_grad and ctx.tp_group is not None and dist.get_world_size(ctx.tp_group) > 1:
                dist.all_reduce(grad_h, op=dist.ReduceOp.SUM, group=ctx.tp_group)
            grad_h = grad_h.to(h_orig.dtype)
        return (None, grad_h, grad_w) + none[3:]


def dual_context_divergence(h_skill: torch.Tensor, h_orig: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                            *, vocab_start: int = 0, tp_group=None, topk: int = 0, backend: str = "auto",
                            temperature: float = 1.0, chunk_size: Optional[int] = None,
                            reduce_hidden_grad: bool = True, vocab_size: Optional[int] = None,
                            saved_logits_bytes: Optional[int] = None) -> dict:
    """Per-token log-probs under both contexts and both KL divergences, vocabulary-parallel, no [N, V] logits.

    Args:
        h_skill: [N, H] (or [..., H]) hidden rows under the skill context (teacher; stop-gradient).
        h_orig: same shape and dtype: the same response tokens under the original context (student).
        weight: [V_local, H] this rank's vocabulary shard of the output layer, same dtype as the hidden rows.
        targets: [N] (or [...]) int64 GLOBAL vocabulary ids (the sampled tokens).
        vocab_start, tp_group, chunk_size, reduce_hidden_grad, vocab_size, saved_logits_bytes: as in
            `fused_logprobs` (the Triton backend's chunks hold both contexts: 2N rows).
        topk: k > 0 also returns the top-k of p_s (merged over TP); 0: none.
        backend: "auto" | "triton" | "torch" (see `_dispatch.py`).
        temperature: T > 0: both distributions are softmax(logits / T); 1.0 skips the division.

    Returns a dict of float32 tensors with targets' shape: `logp_skill`, `logp_orig`, `kl_skill_orig`
    (KL(p_s || p_o)), `kl_orig_skill` (KL(p_o || p_s)); with topk > 0 also `topk_ids` (int64 global ids, [..., k],
    descending p_s), `topk_logp_skill`, `topk_logp_orig` ([..., k]) and `topk_mass` (sum of p_s over the top-k).
    `logp_orig` and both KLs are differentiable w.r.t. h_orig and weight (through the original logits only).
    """
    if h_orig.dim() < 2:
        raise ValueError(f"{_NAME}: h_orig must be [N, H], got shape {tuple(h_orig.shape)}")
    if h_skill.shape != h_orig.shape:
        raise ValueError(f"{_NAME}: h_skill shape {tuple(h_skill.shape)} != h_orig shape {tuple(h_orig.shape)}")
    if weight.dim() != 2 or weight.shape[1] != h_orig.shape[-1]:
        raise ValueError(f"{_NAME}: weight must be [V_local, H={h_orig.shape[-1]}], got {tuple(weight.shape)}")
    if targets.shape != h_orig.shape[:-1]:
        raise ValueError(f"{_NAME}: targets shape {tuple(targets.shape)} != hidden leading shape "
                         f"{tuple(h_orig.shape[:-1])}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{_NAME}: targets must be int64 vocabulary ids, got {targets.dtype}")
    if not (h_skill.dtype == h_orig.dtype == weight.dtype):
        raise ValueError(f"{_NAME}: h_skill {h_skill.dtype}, h_orig {h_orig.dtype} and weight {weight.dtype} must "
                         "share one dtype")
    if not (h_skill.device == h_orig.device == weight.device == targets.device):
        raise ValueError(f"{_NAME}: h_skill, h_orig, weight and targets must be on the same device")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"{_NAME}: chunk_size must be >= 1, got {chunk_size}")
    if int(topk) != topk or topk < 0:
        raise ValueError(f"{_NAME}: topk must be an integer >= 0, got {topk!r}")
    temperature = float(temperature)
    if not (0 < temperature < float("inf")):
        raise ValueError(f"{_NAME}: temperature must be a finite number > 0, got {temperature}")
    lead = targets.shape
    hd = h_orig.shape[-1]
    hs = h_skill.detach().reshape(-1, hd).contiguous()
    ho = h_orig.reshape(-1, hd)
    if not ho.is_contiguous():
        ho = ho.contiguous()
    w = weight if weight.is_contiguous() else weight.contiguous()
    if vocab_size is not None:
        valid = min(weight.shape[0], max(0, int(vocab_size) - int(vocab_start)))
        if valid < weight.shape[0]:
            w = w[:valid]  # a view: autograd gives the padded rows a zero gradient
    tg = targets.reshape(-1).long()
    chosen = resolve_backend(backend, h_orig, _NAME)
    res = _DualDivergence.apply(hs, ho, w, tg, int(vocab_start), tp_group, int(topk), chosen,
                                None if chunk_size is None else int(chunk_size), bool(reduce_hidden_grad),
                                temperature, _fp32_main_grad(weight, w.shape[0]), saved_logits_bytes)
    out = {k: res[i].reshape(lead) for i, k in enumerate(OUTPUT_KEYS)}
    if topk > 0:
        out["topk_ids"] = res[4].reshape(*lead, topk)
        out["topk_logp_skill"] = res[5].reshape(*lead, topk)
        out["topk_logp_orig"] = res[6].reshape(*lead, topk)
        out["topk_mass"] = res[7].reshape(lead)
    return out
