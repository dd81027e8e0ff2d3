"""opid-bench ops on a megatron-core model: dual-context rescoring and training attention.

rescoring        The fork scorer (`ForkScorer`: each step-sample's contexts in one fork group, the shared prefix
                 computed once) against the two-pass naive scorer (`NaiveScorer`: the original and the skill context
                 each its own sequence, what the reference code pays), one forward through the same megatron-core
                 model (TP1, forward only, the log-probs of the response rows only). The model: Qwen2.5's layer
                 shapes of the preset (hidden, FFN, heads, vocabulary; one TP rank's share) over fewer layers
                 (`MODEL`), random weights (seeded). Shapes: the pieces of a real prompt (`PROMPT`) with the skill
                 section inserted late (before the closing paragraph: P = head + middle, T = tail) or faithfully
                 (after the task line: P = head, T = middle + tail), R response tokens, several step-samples per
                 call (`RESCORING`). Error: each row's log-probs under both contexts against the same weights in a
                 float64 forward of the model (`reference_logprobs`, each context its own sequence); the case's
                 `logprob_scale` is the largest |log-prob| of that reference. The case's FLOPs are the fork
                 scorer's exact forward FLOPs (linear layers, causal attention: the prefix once, each branch over
                 prefix + itself; the LM head on the response rows); the naive scorer's are the case's
                 `naive_flops`, and their ratio, the most the fork layout can save, is its `bound_speedup` (also in
                 the case's name). On CPU the model is float32 with our torch paths; on a GPU the preset's dtypes
                 with the Triton kernels.
train_attention  Training attention alone (q, k, v -> out, then the backward of a random upstream gradient to q, k,
                 v) over one packed micro-batch, a plain pack of causal sequences and a fork layout (per group a
                 shared prefix, a skill-context branch and a response branch), the preset's heads of one TP rank:
                 the varlen path (`opid_mega.megatron.attention.varlen_attention`, ONE call over the pack) against
                 the per-sequence loop it replaced (SDPA per sequence; fork layouts: SDPA per group with the group's
                 dense mask) and ONE SDPA with the dense [N, N] mask. Error: the output and the gradients (relative
                 to their largest entry) against a float64 reference (the case's `out_scale`: its largest |output|).
                 Peak memory: minus the output and the q, k, v gradients, which any exact attention returns (they
                 belong to the surrounding layer): the attention's own memory. Bound: 12 FLOPs per attended (query,
                 key) pair, head and head dim (4 in the forward, 8 in the backward). CPU: float32; GPU: the preset's
                 dtypes.
"""
from __future__ import annotations

import atexit
import random

import torch
import torch.nn.functional as F

from .core import Case, Method, Preset, max_abs, rel_max

# preset -> (layers, FFN width of the whole model, tied embeddings): the Qwen2.5 model's layer shapes over fewer
# layers (tiny: a toy)
MODEL = {"tiny": (2, 128, True), "ci": (2, 4864, True), "7b": (4, 18944, False), "32b": (4, 27648, False)}
# preset -> (response tokens R, step-samples per call, the prompt's pieces divided by this: CPU time budget)
RESCORING = {"tiny": (8, 2, 16), "ci": (16, 1, 4), "7b": (160, 8, 1), "32b": (160, 8, 1)}
# Token counts of a real prompt: an ALFWorld-style game (generated locally) at step 3 of its planner walkthrough,
# the verl-agent prompt with a history window of 5 in the Qwen3 chat template. head: the chat header and the task
# line; middle: the history up to the closing paragraph; tail: the closing paragraph and the template's end;
# skill: a rule-analyzer episode skill section.
PROMPT = {"head": 33, "middle": 369, "tail": 73, "skill": 87}
PLACEMENTS = ("late", "faithful")
# preset -> (plain pack: sequence lengths, fork layout: groups of (prefix, (branch lengths, ...))) of one micro-batch
TRAIN_LAYOUTS = {
    "tiny": ((100, 60, 97), ((40, (30, 20)), (25, (8, 12)), (33, ()))),
    "ci": ((300, 200, 256, 268), ((128, (160, 96)), (175, (125, 75)), (120, (90, 30)))),
    "7b": ((1100, 900, 1024, 1200, 850, 1000, 1118, 1000),
           ((512, (640, 384)), (700, (500, 300)), (400, (700, 420)), (600, (560, 380)), (480, (604, 300)))),
}
TRAIN_LAYOUTS["32b"] = TRAIN_LAYOUTS["7b"]


def model_dtypes(preset: Preset, device: torch.device) -> tuple:
    """The model ops' dtypes: the preset's on a GPU; float32 on CPU (what CPU runs score and train in)."""
    return tuple(preset.dtypes) if device.type == "cuda" else ("float32",)


# ------------------------------------------------------------------------------------------------------------------
# rescoring
# ------------------------------------------------------------------------------------------------------------------
def model_dims(preset: Preset) -> dict:
    layers, ffn, tied = MODEL[preset.name]
    return {"hidden": preset.hidden, "layers": layers, "ffn": ffn // preset.tp, "heads": preset.heads_rank,
            "kv_heads": preset.kv_heads_rank, "head_dim": preset.head_dim, "vocab": preset.vocab_rank, "tied": tied}


def rescoring_shape(preset: Preset, placement: str) -> dict:
    """P (shared prefix), S (skill section), T (the prompt after the insertion point), R (response) tokens."""
    r, _, k = RESCORING[preset.name]
    head, middle, tail, skill = (max(1, PROMPT[p] // k) for p in ("head", "middle", "tail", "skill"))
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    P, T = (head + middle, tail) if placement == "late" else (head, middle + tail)
    return {"P": P, "S": skill, "T": T, "R": r}


def scoring_flops(dims: dict, lengths_naive: list, fork_groups: list, resp_rows: int) -> tuple:
    """Exact forward FLOPs (multiply-add = 2) of the naive and the fork scoring: linear layers per token, causal
    attention (naive: each sequence over itself; fork: the prefix once, each branch over prefix + itself), the LM
    head on the response rows (the same in both). `fork_groups`: [(prefix, [branch lengths])]."""
    h, L, f = dims["hidden"], dims["layers"], dims["ffn"]
    hq, hkv, d, v = dims["heads"], dims["kv_heads"], dims["head_dim"], dims["vocab"]
    linear = L * (2 * h * (hq + 2 * hkv) * d + 2 * hq * d * h + 2 * 3 * h * f)
    attn_per_key = L * 4 * hq * d  # QK^T and AV per (query, key) pair
    head = 2 * h * v * resp_rows

    def causal(n, offset=0):  # queries 1..n each seeing offset + i keys
        return n * offset + n * (n + 1) // 2

    naive = sum(linear * n + attn_per_key * causal(n) for n in lengths_naive) + head
    fork = head
    for p, branches in fork_groups:
        fork += linear * (p + sum(branches)) + attn_per_key * (causal(p) + sum(causal(b, p) for b in branches))
    return naive, fork


def arch(dims: dict) -> dict:
    """The model as an architecture dict (`opid_mega.megatron.model.arch_of`): Qwen2 (QKV bias, RMSNorm, SwiGLU,
    RoPE), the preset's shapes of one TP rank."""
    return {"hidden": dims["hidden"], "ffn": dims["ffn"], "layers": dims["layers"], "heads": dims["heads"],
            "kv_heads": dims["kv_heads"], "head_dim": dims["head_dim"], "vocab": dims["vocab"], "eps": 1e-6,
            "rope_theta": 1e6, "qkv_bias": True, "qk_norm": False, "tied": dims["tied"], "max_pos": 4096,
            "model_type": "qwen2"}


def random_weights(a: dict, device: torch.device, seed: int = 0) -> dict:
    """Random float64 weights under their Hugging Face names (seeded): linear weights and biases N(0, 0.02²) as HF
    initialises them, norm weights 1 + N(0, 0.1²) (never exactly one)."""
    g = torch.Generator(device=device).manual_seed(seed)
    h, hq, hkv, d, f, v = a["hidden"], a["heads"], a["kv_heads"], a["head_dim"], a["ffn"], a["vocab"]

    def rand(*shape, std=0.02, mean=0.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64, device=device).mul_(std).add_(mean)

    w = {"model.embed_tokens.weight": rand(v, h), "model.norm.weight": rand(h, std=0.1, mean=1.0)}
    for i in range(a["layers"]):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": rand(h, std=0.1, mean=1.0),
                  p + "post_attention_layernorm.weight": rand(h, std=0.1, mean=1.0),
                  p + "self_attn.q_proj.weight": rand(hq * d, h), p + "self_attn.q_proj.bias": rand(hq * d),
                  p + "self_attn.k_proj.weight": rand(hkv * d, h), p + "self_attn.k_proj.bias": rand(hkv * d),
                  p + "self_attn.v_proj.weight": rand(hkv * d, h), p + "self_attn.v_proj.bias": rand(hkv * d),
                  p + "self_attn.o_proj.weight": rand(h, hq * d), p + "mlp.gate_proj.weight": rand(f, h),
                  p + "mlp.up_proj.weight": rand(f, h), p + "mlp.down_proj.weight": rand(h, f)})
    if not a["tied"]:
        w["lm_head.weight"] = rand(v, h)
    return w


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@torch.no_grad()
def reference_logprobs(w: dict, a: dict, tokens: list, n_resp: int) -> torch.Tensor:
    """log p of the last `n_resp` tokens of `tokens`, one causal sequence (positions 0..L-1), under the Qwen2 model
    of weights `w` (float64, HF names) and architecture `a`: every operation in float64."""
    dev = w["model.embed_tokens.weight"].device
    ids = torch.tensor(tokens, device=dev)
    n, hq, hkv, d = len(tokens), a["heads"], a["kv_heads"], a["head_dim"]
    inv_freq = 1.0 / a["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64, device=dev) / d)
    angle = torch.arange(n, dtype=torch.float64, device=dev)[:, None] * inv_freq[None]
    cos, sin = (torch.cat([t, t], -1)[:, None] for t in (angle.cos(), angle.sin()))

    def rope(t):  # rotate-half RoPE (HF's and megatron-core's)
        return t * cos + torch.cat([-t[..., d // 2:], t[..., :d // 2]], -1) * sin

    causal = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
    x = w["model.embed_tokens.weight"][ids]
    for i in range(a["layers"]):
        p = f"model.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], a["eps"])
        q, k, v = (h @ w[p + f"self_attn.{m}_proj.weight"].T + w[p + f"self_attn.{m}_proj.bias"] for m in "qkv")
        q, k, v = rope(q.view(n, hq, d)), rope(k.view(n, hkv, d)), v.view(n, hkv, d)
        k, v = (t.repeat_interleave(hq // hkv, 1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        x = x + torch.einsum("hqk,khd->qhd", probs, v).reshape(n, hq * d) @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], a["eps"])
        x = x + (F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) \
            @ w[p + "mlp.down_proj.weight"].T
    rows = _rms(x[n - n_resp - 1:n - 1], w["model.norm.weight"], a["eps"])
    head = w["model.embed_tokens.weight" if a["tied"] else "lm_head.weight"]
    logp = (rows @ head.T).log_softmax(-1)
    return logp.gather(-1, ids[-n_resp:, None])[:, 0].cpu()


def _megatron_model(a: dict, dtype: torch.dtype, kernel_backend: str):
    from megatron.core import parallel_state

    from opid_mega.megatron import parallel
    from opid_mega.megatron.model import build_model, transformer_config

    if not parallel_state.model_parallel_is_initialized():  # one in-process rank (TP1 PP1)
        parallel.initialize(tp=1, pp=1, seed=3)
        atexit.register(parallel.destroy)  # the process group ends with the process, never left behind
    return build_model(a, transformer_config(a, dtype=dtype), kernel_backend=kernel_backend)


def _requests(shape: dict, samples: int, vocab: int, seed: int = 0) -> list:
    """Distinct random prompts (no sharing across step-samples: only the dual-context prefix is shared)."""
    from opid_mega.scoring.scorer import ScoreRequest

    rng = random.Random(seed)
    P, S, T, R = shape["P"], shape["S"], shape["T"], shape["R"]
    out = []
    for _ in range(samples):
        prompt = [rng.randrange(vocab) for _ in range(P + T)]
        out.append(ScoreRequest(prompt, [rng.randrange(vocab) for _ in range(R)],
                                {"episode": (P, [rng.randrange(vocab) for _ in range(S)])}))
    return out


def scorers(chunks, max_tokens: int) -> tuple:
    """(NaiveScorer, ForkScorer) over the model chunks: the naive one packs every context as its own sequence, the
    fork one runs the fork layout's micro-batches (no prompt sharing across step-samples)."""
    from opid_mega.megatron.logprobs import PackedBatch, Sample, compute_logprobs
    from opid_mega.scoring.scorer import ForkScorer
    from opid_mega.scoring.scorer import NaiveScorer

    def naive_fn(seqs, temperature=1.0):
        return compute_logprobs(chunks, [Sample(t, s) for t, s in seqs], max_tokens=max_tokens,
                                temperature=temperature)

    def packed_fn(mbs, temperature=1.0):
        return compute_logprobs(chunks, None, batches=[PackedBatch.from_micro_batch(mb) for mb in mbs],
                                temperature=temperature)

    return NaiveScorer(naive_fn), ForkScorer(packed_fn, max_tokens=max_tokens, share_prompts=False)


def rescoring_cases(preset: Preset, device: torch.device, compile_peers: bool = True) -> list:
    from opid_mega.kernels._dispatch import resolve_backend
    from opid_mega.megatron import weights

    dims = model_dims(preset)
    samples = RESCORING[preset.name][1]
    a = arch(dims)
    w = random_weights(a, device)
    work = {}
    for placement in PLACEMENTS:
        shape = rescoring_shape(preset, placement)
        reqs = _requests(shape, samples, dims["vocab"])
        refs = []
        for r in reqs:
            at, section = r.skills["episode"]
            prompt, resp = list(r.prompt_ids), list(r.response_ids)
            refs.append((reference_logprobs(w, a, prompt + resp, len(resp)),
                         reference_logprobs(w, a, prompt[:at] + list(section) + prompt[at:] + resp, len(resp))))
        work[placement] = (shape, reqs, refs)
    kernel_backend = "auto" if device.type == "cuda" else "torch"
    backend = resolve_backend(kernel_backend, torch.empty(1, device=device), "fused_logprobs")
    runs_as = ("Triton (fork attention, fused log-probs)" if backend == "triton" else
               "torch path (fork attention: SDPA per segment; chunked log-probs)")
    cases = []
    for dtype_name in model_dtypes(preset, device):
        chunks = _megatron_model(a, getattr(torch, dtype_name), kernel_backend)
        weights.load_hf_weights(chunks, a, w)
        for placement in PLACEMENTS:
            cases.append(_rescoring_case(chunks, dims, placement, *work[placement], dtype_name, runs_as))
    del w
    return cases


def _rescoring_case(chunks, dims, placement, shape, reqs, refs, dtype_name, runs_as) -> Case:
    P, S, T, R = shape["P"], shape["S"], shape["T"], shape["R"]
    n = len(reqs)
    naive_tokens, fork_tokens = n * (2 * (P + T + R) + S), n * (P + S + 2 * T + 2 * R)
    from opid_mega.scoring.scorer import context_batch, per_sample

    naive, fork = scorers(chunks, naive_tokens + 1)  # every context of the call in one micro-batch
    f_naive, f_fork = scoring_flops(dims, [P + T + R, P + S + T + R] * n, [(P, [S + T + R, T + R])] * n,
                                    resp_rows=2 * R * n)
    ctx, kinds = context_batch(reqs)  # the columns a record hands the scorer

    def error(scores, refs=refs):
        results = per_sample(ctx, kinds, scores)
        return {"orig": max(max_abs(r.orig, o) for r, (o, _) in zip(results, refs)),
                "skill": max(max_abs(r.skill["episode"], s) for r, (_, s) in zip(results, refs))}

    rows = [Method("fork scorer (shared prefix once)", "ours", runs_as, lambda: fork.score(ctx)),
            Method("naive two-pass scorer (each context its own sequence)", "peer", runs_as,
                   lambda: naive.score(ctx))]
    shape_out = dict(shape, samples=n, layers=dims["layers"], ffn=dims["ffn"], naive_tokens=naive_tokens,
                     fork_tokens=fork_tokens)
    bound_speedup = f_naive / f_fork
    # the magnitude the log-probs are rounded at (a tolerance on their error scales with it)
    scale = max(max(o.abs().max().item(), s.abs().max().item()) for o, s in refs)
    return Case(f"{placement} {dtype_name} (FLOP bound ×{bound_speedup:.2f})", shape_out, dtype_name, f_fork, rows,
                error, extra={"placement": placement, "naive_flops": f_naive,
                              "bound_speedup": round(bound_speedup, 4), "logprob_scale": scale})


# ------------------------------------------------------------------------------------------------------------------
# training attention
# ------------------------------------------------------------------------------------------------------------------
def layout_of(layout: tuple) -> tuple:
    """(cu_seqlens list, branch ids list or None) of a plain pack (sequence lengths) or a fork layout (groups of
    (prefix, (branch lengths, ...)))."""
    cu, br = [0], []
    if all(isinstance(x, int) for x in layout):
        for n in layout:
            cu.append(cu[-1] + n)
        return cu, None
    for prefix, branches in layout:
        br += [0] * prefix
        for b, n in enumerate(branches):
            br += [b + 1] * n
        cu.append(len(br))
    return cu, br


def layout_pairs(layout: tuple) -> int:
    """(query, key) pairs the layout lets attend: causal in each sequence; a branch over its prefix and itself."""
    tri = lambda n: n * (n + 1) // 2  # noqa: E731
    if all(isinstance(x, int) for x in layout):
        return sum(tri(n) for n in layout)
    return sum(tri(p) + sum(b * p + tri(b) for b in branches) for p, branches in layout)


def _train_reference(q, k, v, w, cu: list, br, scale: float) -> tuple:
    """float64 output and q, k, v gradients (upstream gradient `w`), one group at a time with its explicit mask."""
    from opid_mega.kernels import fork_attention_mask

    qd, kd, vd = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    outs = []
    for s, e in zip(cu[:-1], cu[1:]):
        bid = br[s:e] if br is not None else torch.zeros(e - s, dtype=torch.int32)
        mask = fork_attention_mask(torch.tensor([0, e - s], dtype=torch.int32), bid).to(q.device)
        qs = qd[s:e].transpose(0, 1)
        ks, vs = (x[s:e].repeat_interleave(rep, 1).transpose(0, 1) for x in (kd, vd))
        scores = (qs @ ks.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
        outs.append((scores.softmax(-1) @ vs).transpose(0, 1))
    out = torch.cat(outs)
    out.backward(w.detach().double())
    return out.detach(), (qd.grad, kd.grad, vd.grad)


def _varlen_runs_as(q: torch.Tensor, branches: bool) -> str:
    from opid_mega.megatron.attention import _cpu_flash_ops, varlen_backend

    backend = varlen_backend(q, branches)
    if backend == "flash_attn":
        return "flash-attn varlen"
    if backend == "torch_varlen":
        return "torch varlen_attn"
    if q.device.type == "cpu" and _cpu_flash_ops() is not None:
        return "CPU flash kernels per segment, one buffer"
    return "SDPA per segment"


def train_attention_cases(preset: Preset, device: torch.device, compile_peers: bool = True) -> list:
    plain, fork = TRAIN_LAYOUTS[preset.name]
    return [_train_case(kind, layout, preset, dtype_name, device) for kind, layout in (("plain", plain),
                                                                                         ("fork", fork))
            for dtype_name in model_dtypes(preset, device)]


def _train_case(kind: str, layout: tuple, preset: Preset, dtype_name: str, device: torch.device) -> Case:
    from opid_mega.kernels import fork_attention_mask
    from opid_mega.megatron.attention import packed_seq_params, segment_attention, varlen_attention

    hq, hkv, d = preset.heads_rank, preset.kv_heads_rank, preset.head_dim
    cu_list, br_list = layout_of(layout)
    n = cu_list[-1]
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, d, generator=g).to(dtype).to(device) for h in (hq, hkv, hkv))
    w = torch.randn(n, hq, d, generator=g).to(dtype).to(device)
    cu = torch.tensor(cu_list, dtype=torch.int32)
    br = None if br_list is None else torch.tensor(br_list, dtype=torch.int32)
    scale = d ** -0.5
    rep = hq // hkv
    ref_out, ref_grads = _train_reference(q, k, v, w, cu_list, br, scale)

    def run(forward):
        qq, kk, vv = (x.detach().requires_grad_(True) for x in (q, k, v))
        out = forward(qq, kk, vv)
        out.backward(w)
        return out.detach(), qq.grad, kk.grad, vv.grad

    # the layout's params are built inside each call, as the trainer builds them once per micro-batch
    def varlen(qq, kk, vv):
        return varlen_attention(qq, kk, vv, packed_seq_params(cu, br, device=device), softmax_scale=scale)

    def loop(qq, kk, vv):
        params = packed_seq_params(cu, br, device=device)
        masks = params.group_masks(device) if params.has_branches else None
        return segment_attention(qq, kk, vv, cu_list, softmax_scale=scale, masks=masks)

    def dense(qq, kk, vv):
        mask = fork_attention_mask(cu.to(device), (br if br is not None else torch.zeros(n, dtype=torch.int32))
                                   .to(device))
        out = F.scaled_dot_product_attention(qq.transpose(0, 1)[None], kk.repeat_interleave(rep, 1).transpose(0, 1)
                                             [None], vv.repeat_interleave(rep, 1).transpose(0, 1)[None],
                                             attn_mask=mask, scale=scale)
        return out[0].transpose(0, 1)

    def error(res):
        out, gq, gk, gv = res
        return {"out": max_abs(out, ref_out), "dq_rel": rel_max(gq, ref_grads[0]),
                "dk_rel": rel_max(gk, ref_grads[1]), "dv_rel": rel_max(gv, ref_grads[2])}

    loop_as = "eager SDPA per group, dense group mask" if br is not None else "eager SDPA per sequence"
    rows = [Method("varlen_attention (one call over the pack)", "ours", _varlen_runs_as(q, br is not None),
                   lambda: run(varlen)),
            Method("per-sequence loop (the previous path)", "peer", loop_as, lambda: run(loop)),
            Method("SDPA with the dense [N, N] mask", "peer", "eager", lambda: run(dense))]
    pairs = layout_pairs(layout)
    shape = {"N": n, ("sequences" if br is None else "groups"): len(cu_list) - 1, "heads": hq, "kv_heads": hkv,
             "head_dim": d, "attended_pairs": pairs}
    interface = (2 * n * hq * d + 2 * n * hkv * d) * q.element_size()  # output, dq, dk, dv
    name = f"{'plain pack' if br is None else 'fork layout'} fwd+bwd {dtype_name}"
    return Case(name, shape, dtype_name, 12 * pairs * hq * d, rows, error, grad_bytes=interface,
                extra={"layout": list(layout) if br is None else [[p, list(b)] for p, b in layout],
                       "out_scale": ref_out.abs().max().item()})


OPS = {
    "rescoring": ("dual-context rescoring on a megatron-core model: fork scorer vs the two-pass naive scorer, late "
                  "and faithful skill placement (forward)", rescoring_cases),
    "train_attention": ("training attention over one packed micro-batch, fwd+bwd: varlen vs the per-sequence loop "
                        "and the dense mask (plain pack, fork layout)", train_attention_cases),
}
