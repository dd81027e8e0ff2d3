"""Core attention over a packed token layout, plugged into megatron-core through the layer ModuleSpec.

A micro-batch is ONE packed row of N tokens holding several sequences. Its layout travels with the batch as
megatron-core's ``PackedSeqParams`` (qkv_format "thd"), passed to ``GPTModel.forward(packed_seq_params=...)`` and
handed by megatron down to every core attention call -- also when activation recompute re-runs a layer in the
backward. :class:`ForkPackedSeqParams` adds our ``branch_ids`` (int32 [N]; 0 = shared prefix at the start of a group,
b >= 1 = branch b) and caches per micro-batch (fork-kernel metadata, device copies, per-group masks). Token i attends
to token j of the same group (``cu_seqlens`` segment) iff j <= i and (branch_ids[j] == 0 or branch_ids[j] ==
branch_ids[i]). A plain packed training batch has no branch ids (all zero): causal attention inside each sequence.
A plain megatron ``PackedSeqParams`` (thd) is accepted as such a batch. Without packed_seq_params every batch row is
one causal sequence.

:class:`PackedCoreAttention` picks its kernel per call:
- scoring (eval mode, no grad): ``opid_mega.kernels.fork_attention`` with the module's ``kernel_backend`` (auto:
  Triton on GPU, per-segment SDPA on CPU);
- training (train mode or grad enabled), plain packs and fork layouts alike: :func:`varlen_attention`, ONE varlen
  call over :class:`VarlenLayout` -- each sequence / fork prefix a causal segment, each branch a segment whose keys
  are [its group's prefix, the branch] with the causal mask aligned bottom-right (= the fork mask; no key of another
  branch is visited). On GPU (fp16/bf16): Transformer Engine's THD ``DotProductAttention`` (plain packs) when TE
  imports, else ``flash_attn_varlen_func`` when flash-attn is installed, else torch's own
  ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10; the flash kernel behind SDPA); on the CPU SDPA's flash
  kernels per segment into one output buffer (:class:`CpuVarlenFlash`); else SDPA per segment
  (:func:`segment_varlen_attention`). Memory grows with sum(Lq * Lk) over segments at most, never N^2.
In train mode the training kernels run also without grad, so the no-grad first forward of a recompute checkpoint and
its re-run in the backward use the same kernel.

Why torch's ``varlen_attn`` rather than flex attention for the GPU without TE / flash-attn (torch 2.11 on the
device we can get has both): ``varlen_attn`` is a plain op over cu_seqlens (no compilation, no block mask to build
per micro-batch, no recompile per packed length), its flash kernel aligns the causal mask bottom-right for Lq != Lk
as flash-attn does, so the fork layout is the same call with gathered keys; eager flex attention materialises the
[N, N] scores and compiled flex recompiles for every new pack length unless marked dynamic. On the CPU neither
runs: ``varlen_attn`` is CUDA-only and flex attention has no CPU backward ("FlexAttention does not support backward
on CPU", torch 2.13, eager and compiled; building a block mask at 4 x 1024 tokens alone took 2 s), so the CPU path
is the same :class:`VarlenLayout` through SDPA's CPU flash kernels (``opid-bench train_attention`` measures it
against the dense mask and the per-sequence loop; docs/performance.md).
"""
from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide

from opid_mega.kernels.fork_attention import build_fork_metadata, fork_attention, fork_attention_mask


@dataclass
class ForkPackedSeqParams(PackedSeqParams):
    """megatron-core ``PackedSeqParams`` (qkv_format "thd") + our fork-layout branch ids and per-batch caches.

    ``cu_seqlens_q`` / ``cu_seqlens_kv`` stay on the host: megatron-core's unfused THD RoPE reads them per sequence
    with ``.tolist()`` / ``.item()`` (a device sync per layer otherwise); the kernels use a device copy made once
    per micro-batch (:meth:`device_cu_seqlens`). Build with :func:`packed_seq_params`."""

    branch_ids: Optional[torch.Tensor] = None  # int32 [N] on the batch's device; None = all zeros
    has_branches: bool = False  # any branch id != 0 (host fact, computed once)

    def __post_init__(self):
        self._cache = {}

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens_q[-1])

    def _cached(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def device_cu_seqlens(self, device) -> torch.Tensor:
        return self._cached(("cu", str(device)), lambda: self.cu_seqlens_q.to(device=device, dtype=torch.int32))

    def branches(self, device) -> torch.Tensor:
        if self.branch_ids is not None:
            return self._cached(("br", str(device)), lambda: self.branch_ids.to(device=device, dtype=torch.int32))
        return self._cached(("br0", str(device)),
                            lambda: torch.zeros(self.num_tokens, dtype=torch.int32, device=device))

    def fork_meta(self, device):
        """Fork-kernel metadata, built once per micro-batch and shared by all layers."""
        return self._cached(("meta", str(device)),
                            lambda: build_fork_metadata(self.device_cu_seqlens(device), self.branches(device)))

    def group_masks(self, device) -> list:
        """Boolean [L_g, L_g] attention mask of each group (True = attend), for training with branches."""
        def make():
            cu = self.cu_seqlens_q.tolist()
            br = self.branches(device)
            return [fork_attention_mask(torch.tensor([0, e - s], dtype=torch.int32), br[s:e])
                    for s, e in zip(cu[:-1], cu[1:])]

        return self._cached(("masks", str(device)), make)

    def varlen_layout(self, device) -> "VarlenLayout":
        """The segments of ONE varlen attention call over this micro-batch (:class:`VarlenLayout`), built once."""
        def make():
            br = None
            if self.has_branches:
                br = self.branch_ids.to("cpu") if self.branch_ids.device.type != "cpu" else self.branch_ids
            return build_varlen_layout(self.cu_seqlens_q.tolist(), br, device)

        return self._cached(("varlen", str(device)), make)

    def thd_params(self, device) -> PackedSeqParams:
        """A plain megatron ``PackedSeqParams`` with device cu_seqlens (for Transformer Engine)."""
        cu = self.device_cu_seqlens(device)
        return self._cached(("thd", str(device)), lambda: PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=self.max_seqlen_q,
            max_seqlen_kv=self.max_seqlen_kv))


def packed_seq_params(cu_seqlens: torch.Tensor, branch_ids: Optional[torch.Tensor] = None,
                      device=None) -> ForkPackedSeqParams:
    """The layout of one packed micro-batch: ``cu_seqlens`` int [G+1] (0 .. N), optional fork ``branch_ids`` [N]
    (moved to ``device``, default: where they are). Host facts (max length, any branch) are computed here, once."""
    cu = torch.as_tensor(cu_seqlens).to(device="cpu", dtype=torch.int32)
    if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must be a non-decreasing 1-D tensor starting at 0, got {cu.tolist()}")
    n = int(cu[-1])
    if branch_ids is not None and branch_ids.numel() != n:
        raise ValueError(f"branch_ids has {branch_ids.numel()} entries, cu_seqlens covers {n} tokens")
    has = branch_ids is not None and n > 0 and bool((branch_ids != 0).any())
    max_len = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    br = None if branch_ids is None else branch_ids.to(device=device or branch_ids.device, dtype=torch.int32)
    return ForkPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len,
                               max_seqlen_kv=max_len, branch_ids=br, has_branches=has)


@functools.lru_cache(maxsize=None)
def _te_available() -> bool:
    from opid_mega.megatron import te_guard

    return te_guard.usable()  # any import problem (OSError from its .so ...) counts as "not installed"


@functools.lru_cache(maxsize=None)
def _flash_attn_varlen():
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:  # noqa: BLE001 - not installed, or a build that fails to load (OSError, undefined symbol)
        return None
    return flash_attn_varlen_func


@dataclass
class VarlenLayout:
    """The segments of ONE varlen attention call over a packed micro-batch, queries in their packed order.

    Segment s: the queries ``q[q_bounds[s]:q_bounds[s+1]]`` against the keys ``gather(k)[k_bounds[s]:k_bounds[s+1]]``
    with the causal mask aligned to the bottom right (query t of an Lq-query segment sees keys 0 .. Lk - Lq + t):
    the causal mask of flash-attn's and torch's ``varlen_attn`` when Lq != Lk. A plain sequence is one segment whose
    keys are its queries (Lq = Lk: ordinary causal). A fork group is its shared prefix (keys: itself), then one
    segment per branch with the keys [prefix, branch] -- which is exactly the fork mask, and no query ever visits a
    key of another branch. ``kv_index`` (int64 [K], on the device; None when the keys are the queries) gathers those
    keys; the prefix's keys are repeated once per branch (K = N + sum over branches of their group's prefix)."""

    q_bounds: list
    k_bounds: list
    cu_q: torch.Tensor  # int32 [S+1] on the device
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    kv_index: Optional[torch.Tensor] = None

    def __post_init__(self):
        self._masks = {}

    @property
    def num_segments(self) -> int:
        return len(self.q_bounds) - 1

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.kv_index is None else x.index_select(0, self.kv_index)

    def segments(self):
        """(q_start, q_end, k_start, k_end) of every segment."""
        qb, kb = self.q_bounds, self.k_bounds
        return [(qb[i], qb[i + 1], kb[i], kb[i + 1]) for i in range(len(qb) - 1)]

    def bottom_right_mask(self, lq: int, lk: int, dtype, device) -> torch.Tensor:
        """Additive mask [1, 1, lq, lk] (0 = attend, -inf = not) of the bottom-right causal mask; cached."""
        key = (lq, lk, dtype, str(device))
        if key not in self._masks:
            keep = torch.ones(lq, lk, dtype=torch.bool, device=device).tril(diagonal=lk - lq)
            self._masks[key] = torch.zeros(lq, lk, dtype=dtype, device=device).masked_fill_(~keep, float("-inf"))[
                None, None]
        return self._masks[key]


def build_varlen_layout(cu_seqlens: list, branch_ids: Optional[torch.Tensor], device) -> VarlenLayout:
    """:class:`VarlenLayout` of a pack: ``cu_seqlens`` host ints [G+1]; ``branch_ids`` int [N] on the host, or None
    (no branches). Inside a group the shared prefix (id 0) comes first and every branch is contiguous (the fork
    layout's rule, ``opid_mega.kernels.fork_attention``); anything else is a ValueError."""
    qb, kb, ranges = [0], [0], []
    identity = branch_ids is None
    br = None if identity else branch_ids.to(torch.int64)
    for g, (s, e) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
        if e <= s:
            continue
        if identity or not bool((br[s:e] != 0).any()):
            runs = [(s, e, 0)]
        else:
            b = br[s:e]
            cuts = (torch.nonzero(b[1:] != b[:-1]).flatten() + 1).tolist()
            edges = [0] + cuts + [e - s]
            runs = [(s + a, s + z, int(b[a])) for a, z in zip(edges[:-1], edges[1:])]
        seen, prefix = set(), None
        for i, (a, z, bid) in enumerate(runs):
            if bid == 0 and i > 0:
                raise ValueError(f"fork layout: token {a} has branch id 0 after a branch started in group {g} (the "
                                 "shared prefix must come first)")
            if bid in seen:
                raise ValueError(f"fork layout: branch {bid} of group {g} is not contiguous (token {a})")
            seen.add(bid)
            if bid == 0:
                prefix = (a, z)
                keys = [(a, z)]
            else:
                keys = ([prefix] if prefix is not None else []) + [(a, z)]
            qb.append(qb[-1] + z - a)
            kb.append(kb[-1] + sum(y - x for x, y in keys))
            ranges += keys
    kv_index = None
    if not identity and kb[-1] != qb[-1]:
        kv_index = torch.cat([torch.arange(a, z, dtype=torch.int64) for a, z in ranges]).to(device)
    lq = [b - a for a, b in zip(qb[:-1], qb[1:])]
    lk = [b - a for a, b in zip(kb[:-1], kb[1:])]
    as_dev = lambda xs: torch.tensor(xs, dtype=torch.int32).to(device)  # noqa: E731
    return VarlenLayout(q_bounds=qb, k_bounds=kb, cu_q=as_dev(qb), cu_k=as_dev(kb), max_q=max(lq, default=0),
                        max_k=max(lk, default=0), kv_index=kv_index)


@functools.lru_cache(maxsize=None)
def _torch_varlen():
    """torch's own varlen attention (``torch.nn.attention.varlen.varlen_attn``, torch >= 2.10: flash attention over
    cu_seqlens, CUDA fp16/bf16, no dropout) and how to call it on this torch: (fn, keyword arguments for a causal
    call, whether it takes ``scale``, whether GQA needs ``enable_gqa``). None where this torch lacks it."""
    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn

        params = inspect.signature(varlen_attn).parameters
    except Exception:  # noqa: BLE001 - older torch, or a build without it
        return None
    if "window_size" in params:  # torch >= 2.11: (-1, 0) is causal (a tuple: the API compares with ==)
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:  # torch 2.10
        causal = {"is_causal": True}
    else:
        return None
    return varlen_attn, causal, "scale" in params, "enable_gqa" in params


def _call_torch_varlen(q, k, v, lay: VarlenLayout, softmax_scale: float) -> torch.Tensor:
    fn, causal, has_scale, has_gqa = _torch_varlen()
    kw = dict(causal)
    if has_scale:
        kw["scale"] = softmax_scale
    else:  # its fixed scale is 1/sqrt(D): fold ours into q
        q = q * (softmax_scale * math.sqrt(q.shape[-1]))
    if has_gqa and q.shape[1] != k.shape[1]:
        kw["enable_gqa"] = True  # (the flash kernel takes fewer KV heads natively; newer torch wants it said)
    return fn(q, k, v, lay.cu_q, lay.cu_k, lay.max_q, lay.max_k, **kw)


def segment_varlen_attention(q, k, v, lay: VarlenLayout, *, softmax_scale: float,
                             dropout_p: float = 0.0) -> torch.Tensor:
    """The varlen call of :class:`VarlenLayout` one segment at a time with SDPA (any device, dtype, dropout): the
    fallback where no varlen kernel applies. Memory per segment Lq * Lk at most (math backend), never N^2."""
    kk, vv = lay.gather(k), lay.gather(v)
    gqa = q.shape[1] != k.shape[1]
    outs = []
    for a, b, c, d in lay.segments():
        qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q[a:b], kk[c:d], vv[c:d]))
        if b - a == d - c:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, dropout_p=dropout_p, scale=softmax_scale,
                                               enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=lay.bottom_right_mask(b - a, d - c, q.dtype,
                                                                                           q.device),
                                               dropout_p=dropout_p, scale=softmax_scale, enable_gqa=gqa)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs) if outs else q.new_zeros(q.shape)


def segment_attention(q, k, v, cu_seqlens: list, *, softmax_scale: float, dropout_p: float = 0.0,
                      masks: Optional[list] = None) -> torch.Tensor:
    """Attention of each ``cu_seqlens`` segment on its own with SDPA (causal, or ``masks[g]`` when given).

    q: [N, Hq, D], k, v: [N, Hkv, D] (GQA by ``enable_gqa``); ``cu_seqlens``: host ints. Returns [N, Hq, D].
    Differentiable; memory grows with sum(len^2) at most (SDPA's math fallback; CPU flash attention, used without a
    mask, needs O(len) per segment), never with N^2."""
    gqa = q.shape[1] != k.shape[1]
    lens = [e - s for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    # split, not slices: the backward of a slice allocates a zero gradient of the whole [N, H, D] input per segment
    parts = zip(q.split(lens), k.split(lens), v.split(lens))
    outs = []
    for g, (length, qkv) in enumerate(zip(lens, parts)):
        if length == 0:
            continue
        qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in qkv)  # [1, H, L, D]
        if masks is None:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, dropout_p=dropout_p, scale=softmax_scale,
                                               enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=masks[g], dropout_p=dropout_p,
                                               scale=softmax_scale, enable_gqa=gqa)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs) if outs else q.new_zeros(q.shape)


def _cpu_flash_ops():
    """aten's CPU flash-attention kernels (what SDPA calls on the CPU), or None where this torch lacks them."""
    aten = torch.ops.aten
    names = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward")
    if not all(hasattr(aten, n) for n in names):
        return None
    return tuple(getattr(aten, n) for n in names)


class CpuVarlenFlash(torch.autograd.Function):
    """The varlen call of a :class:`VarlenLayout` on the CPU: aten's CPU flash-attention kernels (what SDPA calls
    there; GQA native) per segment on strided views, ONE output and ONE gradient buffer per tensor.

    Square segments (plain sequences, fork prefixes) run causal without a mask; a branch's segment (Lq < Lk) takes
    the bottom-right causal mask as an additive [Lq, Lk] mask. Only the per-segment log-sum-exp ([H, Lq] floats) is
    kept for the backward besides q, k, v and the output, so the attention's own memory is O(N * H) (plus the masks
    of the branch shapes), not the per-segment output and gradient copies that autograd through per-segment SDPA
    calls + ``torch.cat`` would keep. ``k``, ``v``: the gathered keys (``VarlenLayout.gather``)."""

    @staticmethod
    def forward(ctx, q, k, v, lay: VarlenLayout, scale: float):
        fwd, _ = _cpu_flash_ops()
        out = q.new_empty(q.shape)
        lses = []
        for a, b, c, d in lay.segments():
            mask = None if b - a == d - c else lay.bottom_right_mask(b - a, d - c, q.dtype, q.device)
            o, lse = fwd(q[a:b].transpose(0, 1)[None], k[c:d].transpose(0, 1)[None], v[c:d].transpose(0, 1)[None],
                         0.0, mask is None, attn_mask=mask, scale=scale)
            out[a:b] = o[0].transpose(0, 1)
            lses.append(lse)
        ctx.save_for_backward(q, k, v, out, *lses)
        ctx.lay, ctx.scale = lay, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        _, bwd = _cpu_flash_ops()
        q, k, v, out, *lses = ctx.saved_tensors
        lay = ctx.lay
        grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
        grads = [torch.zeros_like(x) for x in (q, k, v)]
        for i, (a, b, c, d) in enumerate(lay.segments()):
            mask = None if b - a == d - c else lay.bottom_right_mask(b - a, d - c, q.dtype, q.device)
            seg = [x.transpose(0, 1)[None] for x in (grad_out[a:b], q[a:b], k[c:d], v[c:d], out[a:b])]
            gq, gk, gv = bwd(*seg, lses[i], 0.0, mask is None, attn_mask=mask, scale=ctx.scale)
            grads[0][a:b] = gq[0].transpose(0, 1)
            grads[1][c:d] += gk[0].transpose(0, 1)  # keys of a segment are its own rows of the gathered k
            grads[2][c:d] += gv[0].transpose(0, 1)
        return grads[0], grads[1], grads[2], None, None


def varlen_backend(q: torch.Tensor, branches: bool = False, dropout_p: float = 0.0) -> str:
    """The kernel :func:`varlen_attention` uses for ``q``: "te" | "flash_attn" | "torch_varlen" | "sdpa" (SDPA's
    kernels per segment: on the CPU its flash kernels into one buffer, :class:`CpuVarlenFlash`; elsewhere
    :func:`segment_varlen_attention`). ``branches``: a fork layout, which Transformer Engine's THD call does not
    take; ``dropout_p`` > 0: torch's varlen_attn has no dropout."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        if not branches and _te_available():
            return "te"
        if _flash_attn_varlen() is not None:
            return "flash_attn"
        if _torch_varlen() is not None and dropout_p == 0.0:
            return "torch_varlen"
    return "sdpa"


def varlen_attention(q, k, v, params: ForkPackedSeqParams, *, softmax_scale: float, dropout_p: float = 0.0,
                     te_module=None, dropout_rng=None) -> torch.Tensor:
    """Training attention over a packed micro-batch -- plain sequences (causal inside each) or a fork layout
    (branches) -- as ONE varlen call over :meth:`ForkPackedSeqParams.varlen_layout`. q: [N, Hq, D], k, v:
    [N, Hkv, D] -> [N, Hq, D].

    GPU with fp16/bf16: Transformer Engine (``te_module``, megatron's ``TEDotProductAttention``, THD format, plain
    layouts; it forks megatron's RNG tracker for its dropout itself), else flash-attn's ``flash_attn_varlen_func``,
    else torch's own ``torch.nn.attention.varlen.varlen_attn`` (no dropout) -- the last two with the causal mask
    aligned bottom-right, which the fork layout's branch segments need. CPU: :class:`CpuVarlenFlash` (SDPA's CPU
    flash kernels per segment, one output buffer). Otherwise (GPU fp32, dropout without flash-attn, neither
    kernel): :func:`segment_varlen_attention`. ``dropout_rng``: the context for the dropout of the last ones and of
    flash-attn (megatron's RNG tracker)."""
    backend = varlen_backend(q, params.has_branches, dropout_p)
    if backend == "te" and te_module is not None:
        from megatron.core.transformer.enums import AttnMaskType

        out = te_module(q, k, v, None, attn_mask_type=AttnMaskType.causal,
                        packed_seq_params=params.thd_params(q.device))
        return out.reshape(q.shape)
    lay = params.varlen_layout(q.device)
    if backend == "torch_varlen":
        return _call_torch_varlen(q, lay.gather(k), lay.gather(v), lay, softmax_scale)
    with dropout_rng if dropout_rng is not None else contextlib.nullcontext():
        if backend == "flash_attn":
            return _flash_attn_varlen()(q, lay.gather(k), lay.gather(v), lay.cu_q, lay.cu_k, lay.max_q, lay.max_k,
                                        dropout_p=dropout_p, softmax_scale=softmax_scale, causal=True)
        if q.device.type == "cpu" and dropout_p == 0.0 and _cpu_flash_ops() is not None:
            q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
            return CpuVarlenFlash.apply(q, lay.gather(k), lay.gather(v), lay, softmax_scale)
        return segment_varlen_attention(q, k, v, lay, softmax_scale=softmax_scale, dropout_p=dropout_p)


def as_fork_params(params: PackedSeqParams) -> ForkPackedSeqParams:
    """Our params as they are; a plain megatron ``PackedSeqParams`` (thd, no padding) as a branch-free layout."""
    if isinstance(params, ForkPackedSeqParams):
        return params
    cached = getattr(params, "_opid_fork_params", None)
    if cached is not None:
        return cached
    if params.qkv_format != "thd":
        raise ValueError(f"PackedCoreAttention needs qkv_format 'thd', got {params.qkv_format!r}")
    if params.cu_seqlens_q_padded is not None or (params.cu_seqlens_kv is not None
                                                  and not torch.equal(params.cu_seqlens_kv, params.cu_seqlens_q)):
        raise ValueError("PackedCoreAttention: padded or cross (q != kv) cu_seqlens are not supported")
    params._opid_fork_params = packed_seq_params(params.cu_seqlens_q)  # once per micro-batch, not per layer
    return params._opid_fork_params


_TE_CHILD = "te_attention"
_NO_STATE = object()


def _hide_te_extra_state(module, state_dict, prefix, local_metadata):
    state_dict.pop(f"{prefix}{_TE_CHILD}._extra_state", None)


def _route_te_extra_state(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                          error_msgs):
    legacy = state_dict.pop(f"{prefix}{_TE_CHILD}._extra_state", _NO_STATE)
    own = state_dict.get(f"{prefix}_extra_state", _NO_STATE)
    state = own if own is not _NO_STATE else (legacy if legacy is not _NO_STATE else None)
    state_dict[f"{prefix}_extra_state"] = state
    if module.te_attention is not None:
        state_dict[f"{prefix}{_TE_CHILD}._extra_state"] = state


KERNEL_BACKENDS = ("auto", "triton", "torch")


class PackedCoreAttention(MegatronModule):
    """Drop-in for megatron's ``DotProductAttention`` (same constructor) that understands packed layouts
    (:class:`ForkPackedSeqParams`, or a plain thd ``PackedSeqParams``).

    ``kernel_backend`` ("auto" | "triton" | "torch"): the ``backend`` of the ``opid_mega.kernels`` call it makes (the
    scoring fork kernel); set through the layer spec's ``ModuleSpec.params`` (``opid_mega.megatron.model.layer_spec``).
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, *, kernel_backend: str = "auto"):
        if kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(f"PackedCoreAttention: kernel_backend must be one of {KERNEL_BACKENDS}, got "
                             f"{kernel_backend!r}")
        super().__init__(config=config)
        self.kernel_backend = kernel_backend
        if config.context_parallel_size != 1:
            raise ValueError("PackedCoreAttention does not support context parallelism")
        if config.apply_rope_fusion:
            raise ValueError("apply_rope_fusion must be False: OpidGPTModel passes per-token rotary frequencies "
                             "(packed and fork positions) that the fused THD RoPE kernel would re-index")
        from megatron.core import parallel_state

        tp = parallel_state.get_tensor_model_parallel_world_size() if pg_collection is None else pg_collection.tp.size()
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups or config.num_attention_heads, tp)
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.te_attention = None
        if torch.cuda.is_available() and _te_available():  # the THD varlen kernel for training on GPU
            from megatron.core.extensions.transformer_engine import TEDotProductAttention

            self.te_attention = TEDotProductAttention(config, layer_number, attn_mask_type, attention_type,
                                                      attention_dropout=attention_dropout,
                                                      softmax_scale=self.softmax_scale, cp_comm_type=cp_comm_type,
                                                      pg_collection=pg_collection)

        # Checkpoint keys are the same with and without TE: ONE ``<prefix>_extra_state`` here, where megatron's TE
        # GPTModel keeps its TEDotProductAttention's (``...core_attention._extra_state``); the TE child's own
        # ``te_attention._extra_state`` never reaches a state dict. A state dict that lacks the key (written by a
        # model without it) loads as None; one with the child's key (written before this mapping) loads that.
        self._register_state_dict_hook(_hide_te_extra_state)
        self._register_load_state_dict_pre_hook(_route_te_extra_state, with_module=True)

    def get_extra_state(self):
        """TE's attention state (fp8 metadata; None without TE): saved under this module's ``_extra_state``."""
        return self.te_attention.get_extra_state() if self.te_attention is not None else None

    def set_extra_state(self, state) -> None:
        """Nothing to keep here: the load pre-hook hands the state to the TE child (which ignores None)."""

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        for key in [k for k in sd if k.startswith(f"{prefix}{_TE_CHILD}.")]:
            del sd[key]
        return sd

    def _dropout_p(self) -> float:
        return self.dropout if self.training else 0.0

    def _rng(self):
        from megatron.core import tensor_parallel

        if self._dropout_p() > 0 and not self.config.sequence_parallel:  # as megatron's DotProductAttention
            return tensor_parallel.get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("PackedCoreAttention does not take an attention_bias")
        if packed_seq_params is None:  # [s, b, h, d]: every row one causal sequence
            s, b = query.shape[0], query.shape[1]
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, h, s, d]
            with self._rng():
                ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self._dropout_p(),
                                                     scale=self.softmax_scale, enable_gqa=self.heads != self.groups)
            return ctx.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.head_dim)
        params = as_fork_params(packed_seq_params)
        if query.dim() == 4:  # [t, 1, h, d] (megatron squeezes it for thd; accept it unsqueezed too)
            if query.shape[1] != 1:
                raise ValueError(f"a packed layout needs batch size 1, got {query.shape[1]}")
            query, key, value = query[:, 0], key[:, 0], value[:, 0]
        n = query.shape[0]
        if params.num_tokens != n:
            raise ValueError(f"packed layout covers {params.num_tokens} tokens, the sequence has {n}")
        if not self.training and not torch.is_grad_enabled():  # scoring: the fork kernel (forward only)
            out = fork_attention(query, key, value, params.device_cu_seqlens(query.device),
                                 params.branches(query.device), softmax_scale=self.softmax_scale,
                                 meta=params.fork_meta(query.device), backend=self.kernel_backend)
        else:  # training, plain or fork layout: one varlen call
            out = varlen_attention(query, key, value, params, softmax_scale=self.softmax_scale,
                                   dropout_p=self._dropout_p(), te_module=self.te_attention, dropout_rng=self._rng())
        return out.reshape(n, 1, self.heads * self.head_dim)
