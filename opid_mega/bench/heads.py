"""Vocabulary heads: token log-probs (fwd, fwd+bwd) and the dual-context divergence, ours vs the peers."""
from __future__ import annotations

import torch

from opid_mega.kernels import dual_context_divergence, fused_logprobs, naive_divergence, naive_logprobs
from opid_mega.kernels.logprob import triton_chunk_columns

from .core import Case, Method, Preset, interpreter_enabled, max_abs, rel_max
from .roofline import divergence_steps, logprob_steps

# The Triton interpreter runs every program instance in Python: on CPU only cases this small run through it.
INTERPRETER_MAX_ELEMENTS = 100_000


def _liger(name: str):
    try:
        if name == "ce":
            from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction as fn
        else:
            from liger_kernel.ops.fused_linear_jsd import LigerFusedLinearJSDFunction as fn
        return fn, None
    except Exception as exc:  # noqa: BLE001
        return None, f"liger-kernel not importable ({type(exc).__name__}); pip install liger-kernel"


def _triton_rows(device: torch.device, elements: int, what: str):
    """(runs_as, skip reason) of a Triton row: ours' Triton kernel or a Triton peer such as Liger."""
    if device.type == "cuda":
        return "Triton", None
    if not interpreter_enabled():
        return "Triton interpreter", "CPU without TRITON_INTERPRET=1 at start: Triton cannot run"
    if elements > INTERPRETER_MAX_ELEMENTS:
        return "Triton interpreter", (f"Triton interpreter too slow for {what} at N×V = {elements:,} "
                                      f"(runs up to {INTERPRETER_MAX_ELEMENTS:,}: preset tiny)")
    return "Triton interpreter", None


def compiled_peer(naive, call, compile_peers: bool) -> Method:
    """The torch.compile row of a naive path (skipped with --no-compile); `call(f)` times the case with `f`."""
    if not compile_peers:
        return Method("torch.compile(naive)", "peer", "inductor", skipped="--no-compile")
    compiled = torch.compile(naive, dynamic=False)
    return Method("torch.compile(naive)", "peer", "inductor", lambda: call(compiled))


def _inputs(n, h, v, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype).to(device)
    weight = (torch.randn(v, h, generator=g) / h ** 0.5).to(dtype).to(device)
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    return hidden, weight, targets


def logprob_cases(preset: Preset, device: torch.device, compile_peers: bool = True) -> list:
    """-log p of the sampled tokens (the PPO ratio's log-probs); one more case (the first dtype, the preset's last
    pass) also returns the entropy of every row (`return_entropy`, the PPO entropy term): Liger's CE has none."""
    n, h, v = preset.tokens, preset.hidden, preset.vocab_rank
    return [_logprob_case(n, h, v, dtype_name, pass_, device, compile_peers)
            for dtype_name in preset.dtypes for pass_ in preset.passes
            if pass_ == "fwd" or dtype_name not in preset.fwd_only] + \
        [_logprob_case(n, h, v, preset.dtypes[0], preset.passes[-1], device, compile_peers, entropy=True)]


def _logprob_case(n, h, v, dtype_name, pass_, device, compile_peers, entropy: bool = False) -> Case:
    dtype = getattr(torch, dtype_name)
    hidden, weight, targets = _inputs(n, h, v, dtype, device)
    backward = pass_ == "fwd+bwd"
    hd, wd = hidden.double().requires_grad_(backward), weight.double().requires_grad_(backward)
    logp = torch.log_softmax(hd @ wd.t(), -1)
    ref = logp.gather(1, targets[:, None])[:, 0]
    ref_ent = -(logp.exp() * logp).sum(-1) if entropy else None
    if backward:
        ref_gh, ref_gw = torch.autograd.grad(ref.sum() + (ref_ent.sum() if entropy else 0), (hd, wd))
    ref = ref.detach()
    ref_ent = ref_ent.detach() if entropy else None

    def run(fn, hidden=hidden, weight=weight, backward=backward):
        """(log-probs, grad hidden, grad weight, entropy): the gradients of sum(log-probs) (+ sum(entropy))."""
        hh = hidden.detach().requires_grad_(backward)
        ww = weight.detach().requires_grad_(backward)
        out = fn(hh, ww)
        lp, ent = out if entropy else (out, None)
        if backward:
            (lp.sum() + (ent.sum() if entropy else 0)).backward()
        return (lp.detach(), hh.grad if backward else None, ww.grad if backward else None,
                ent.detach() if entropy else None)

    def error(res, ref=ref, backward=backward):
        e = {"logprob": max_abs(res[0], ref)}
        if entropy:
            e["entropy"] = max_abs(res[3], ref_ent)
        if backward:
            e["grad_hidden_rel"] = rel_max(res[1], ref_gh)
            e["grad_weight_rel"] = rel_max(res[2], ref_gw)
        return e

    rows = []
    if device.type == "cuda":
        rows.append(Method("fused_logprobs", "ours", "Triton", lambda: run(
            lambda hh, ww: fused_logprobs(hh, ww, targets, return_entropy=entropy, backend="triton"))))
    rows.append(Method("fused_logprobs", "ours", "torch path (chunked)", lambda: run(
        lambda hh, ww: fused_logprobs(hh, ww, targets, return_entropy=entropy, backend="torch"))))
    if device.type != "cuda":
        runs_as, skip = _triton_rows(device, n * v, "fused_logprobs")
        rows.append(Method("fused_logprobs", "ours", runs_as, None if skip else lambda: run(
            lambda hh, ww: fused_logprobs(hh, ww, targets, return_entropy=entropy, backend="triton")), skip))
    rows.append(Method("naive full logits", "peer", "eager", lambda: run(
        lambda hh, ww: naive_logprobs(hh, ww, targets, return_entropy=entropy))))
    rows.append(compiled_peer(naive_logprobs, lambda c: run(lambda hh, ww: c(hh, ww, targets,
                                                                              return_entropy=entropy)),
                              compile_peers))
    fn, why = _liger("ce")
    runs_as, skip = _triton_rows(device, n * v, "Liger")
    skip = ("no entropy output (fused linear CE returns the loss)" if entropy else None) or why or skip
    rows.append(Method("Liger fused linear CE", "peer", runs_as, None if skip else lambda fn=fn: run(
        lambda hh, ww: -fn.apply(hh, ww, targets, None, None, -100, 0.0, 0.0, "none")[0].float()), skip))
    grad_bytes = (n * h + v * h) * hidden.element_size() if backward else 0
    shape = {"N": n, "H": h, "V": v, **({"entropy": True} if entropy else {})}
    cols = triton_chunk_columns(n, v)
    kept = 1 if backward else 0
    config = {"chunk columns": cols, "chunks": -(-v // cols), "kept for the backward": kept}
    return Case(f"{pass_} {dtype_name}" + (" +entropy" if entropy else ""), shape, dtype_name,
                (6 if backward else 2) * n * h * v, rows, error, grad_bytes,
                roofline=lambda: (config, logprob_steps(n, h, v, hidden.element_size(), cols, backward, kept)))


def divergence_cases(preset: Preset, device: torch.device, compile_peers: bool = True) -> list:
    """Per token: log p under both contexts and KL(p_skill || p_orig), KL(p_orig || p_skill); fwd+bwd through the
    original context. Liger's fused linear JSD (beta 0 = KL(teacher || student), mean over tokens) is its peer: it
    returns only the mean, so its error is that of the mean forward KL. One more case (the first dtype) also keeps
    the top-TOPK of p_skill per token (`algo.delta=topk_kl`): ours keeps a running top-k per vocabulary chunk, the
    naive path takes `torch.topk` of the full row; Liger has no top-k (skipped)."""
    n, h, v = preset.tokens, preset.hidden, preset.vocab_rank
    dtypes = preset.divergence_dtypes or preset.dtypes
    return [_divergence_case(n, h, v, dtype_name, device, compile_peers) for dtype_name in dtypes] + \
        [_divergence_case(n, h, v, dtypes[0], device, compile_peers, topk=TOPK)]


TOPK = 32  # algo.delta=topk_kl's default k


def _divergence_case(n, h, v, dtype_name, device, compile_peers, topk: int = 0) -> Case:
    dtype = getattr(torch, dtype_name)
    h_skill, weight, targets = _inputs(n, h, v, dtype, device, seed=1)
    h_orig = (h_skill.float() + 0.5 * torch.randn(n, h, generator=torch.Generator().manual_seed(2))
              .to(device)).to(dtype)
    hod, wd = h_orig.double().requires_grad_(True), weight.double().requires_grad_(True)
    a = torch.log_softmax(h_skill.double() @ weight.double().t(), -1)
    b = torch.log_softmax(hod @ wd.t(), -1)
    kl_so = (a.exp() * (a - b)).sum(-1)
    kl_os = (b.exp() * (b - a)).sum(-1)
    ref_lo = b.gather(1, targets[:, None])[:, 0]
    ref_gh, ref_gw = torch.autograd.grad((kl_so + kl_os + ref_lo).sum(), (hod, wd))
    ref = {"kl_skill_orig": kl_so.detach(), "kl_orig_skill": kl_os.detach(), "logp_orig": ref_lo.detach()}
    if topk:
        ref_topk, ref_ids = a.detach().topk(topk, dim=-1)
        ref["topk_logp_skill"] = ref_topk
        ref["topk_logp_orig"] = b.detach().gather(1, ref_ids)

    def run(fn, h_orig=h_orig, h_skill=h_skill, weight=weight):
        ho = h_orig.detach().requires_grad_(True)
        ww = weight.detach().requires_grad_(True)
        out = fn(h_skill, ho, ww)
        if isinstance(out, dict):
            loss = (out["kl_skill_orig"] + out["kl_orig_skill"] + out["logp_orig"]).sum()
            loss.backward()
            got = {k: out[k].detach() for k in ref}
            if topk:
                got["topk_ids"] = out["topk_ids"].detach()
            return got, ho.grad, ww.grad
        out.backward()
        return {"kl_skill_orig_mean": out.detach()}, None, None

    def error(res, ref=ref):
        outs, gh, gw = res
        if "kl_skill_orig_mean" in outs:
            return {"kl_mean": max_abs(outs["kl_skill_orig_mean"], ref["kl_skill_orig"].mean())}
        e = {k: max_abs(outs[k], ref[k]) for k in ref}
        if topk:  # ids the float64 top-k ranks differently (near-ties in the low precision dtypes)
            e["topk_ids_differ"] = float((outs["topk_ids"].cpu() != ref_ids.cpu()).sum())
        e["grad_hidden_rel"] = rel_max(gh, ref_gh)
        e["grad_weight_rel"] = rel_max(gw, ref_gw)
        return e

    rows = []
    if device.type == "cuda":
        rows.append(Method("dual_context_divergence", "ours", "Triton", lambda: run(
            lambda hs, ho, ww: dual_context_divergence(hs, ho, ww, targets, topk=topk, backend="triton"))))
    rows.append(Method("dual_context_divergence", "ours", "torch path (chunked)", lambda: run(
        lambda hs, ho, ww: dual_context_divergence(hs, ho, ww, targets, topk=topk, backend="torch"))))
    if device.type != "cuda":
        runs_as, skip = _triton_rows(device, n * v, "dual_context_divergence")
        rows.append(Method("dual_context_divergence", "ours", runs_as, None if skip else lambda: run(
            lambda hs, ho, ww: dual_context_divergence(hs, ho, ww, targets, topk=topk, backend="triton")), skip))
    rows.append(Method("naive two full log-softmaxes", "peer", "eager", lambda: run(
        lambda hs, ho, ww: naive_divergence(hs, ho, ww, targets, topk=topk))))
    rows.append(compiled_peer(naive_divergence, lambda c: run(lambda hs, ho, ww: c(hs, ho, ww, targets, topk=topk)),
                              compile_peers))
    fn, why = _liger("jsd")
    runs_as, skip = _triton_rows(device, n * v, "Liger")
    skip = ("no top-k output (fused linear JSD returns the mean divergence only)" if topk else None) or why or skip
    rows.append(Method("Liger fused linear JSD (beta 0)", "peer", runs_as, None if skip else lambda fn=fn: run(
        lambda hs, ho, ww: fn.apply(ho, ww, hs, ww.detach(), None, 0.0, -100, 1.0)), skip))
    grad_bytes = (n * h + v * h) * h_orig.element_size()
    shape = {"N": n, "H": h, "V": v, **({"topk": topk} if topk else {})}
    cols = triton_chunk_columns(2 * n, v)
    config = {"chunk columns": cols, "chunks": -(-v // cols), "kept for the backward": 1}
    # FLOPs: both contexts' logits (4NHV) and the two gradient GEMMs through the original ones (4NHV)
    return Case(f"fwd+bwd {dtype_name}" + (f" top-{topk}" if topk else ""), shape, dtype_name, 8 * n * h * v,
                rows, error, grad_bytes,
                roofline=lambda: (config, divergence_steps(n, h, v, h_orig.element_size(), cols, topk, True)))


OPS = {
    "logprob": ("token log-probs from hidden states, fwd and fwd+bwd (fused_logprobs)", logprob_cases),
    "divergence": ("dual-context divergence head: log-probs under both contexts and both KLs, fwd+bwd",
                   divergence_cases),
}
