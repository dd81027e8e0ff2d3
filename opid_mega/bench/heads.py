"""Vocabulary heads: token log-probs (fwd, fwd+bwd) and the dual-context divergence, ours vs the peers."""
from __future__ import annotations

import torch

from opid_mega.kernels import dual_context_divergence, fused_logprobs, naive_divergence, naive_logprobs

from .core import Case, Method, Preset, interpreter_enabled, max_abs, rel_max

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
    n, h, v = preset.tokens, preset.hidden, preset.vocab_rank
    return [_logprob_case(n, h, v, dtype_name, pass_, device, compile_peers)
            for dtype_name in preset.dtypes for pass_ in preset.passes
            if pass_ == "fwd" or dtype_name not in preset.fwd_only]


def _logprob_case(n, h, v, dtype_name, pass_, device, compile_peers) -> Case:
    if True:
        if True:
            dtype = getattr(torch, dtype_name)
            hidden, weight, targets = _inputs(n, h, v, dtype, device)
            backward = pass_ == "fwd+bwd"
            hd, wd = hidden.double().requires_grad_(backward), weight.double().requires_grad_(backward)
            ref = torch.log_softmax(hd @ wd.t(), -1).gather(1, targets[:, None])[:, 0]
            if backward:
                ref_gh, ref_gw = torch.autograd.grad(ref.sum(), (hd, wd))
            ref = ref.detach()

            def run(fn, hidden=hidden, weight=weight, backward=backward):
                hh = hidden.detach().requires_grad_(backward)
                ww = weight.detach().requires_grad_(backward)
                lp = fn(hh, ww)
                if backward:
                    lp.sum().backward()
                    return lp.detach(), hh.grad, ww.grad
                return (lp.detach(),)

            def error(res, ref=ref, backward=backward):
                e = {"logprob": max_abs(res[0], ref)}
                if backward:
                    e["grad_hidden_rel"] = rel_max(res[1], ref_gh)
                    e["grad_weight_rel"] = rel_max(res[2], ref_gw)
                return e

            rows = []
            if device.type == "cuda":
                rows.append(Method("fused_logprobs", "ours", "Triton", lambda: run(
                    lambda hh, ww: fused_logprobs(hh, ww, targets, backend="triton"))))
            rows.append(Method("fused_logprobs", "ours", "torch path (chunked)", lambda: run(
                lambda hh, ww: fused_logprobs(hh, ww, targets, backend="torch"))))
            if device.type != "cuda":
                runs_as, skip = _triton_rows(device, n * v, "fused_logprobs")
                rows.append(Method("fused_logprobs", "ours", runs_as, None if skip else lambda: run(
                    lambda hh, ww: fused_logprobs(hh, ww, targets, backend="triton")), skip))
            rows.append(Method("naive full logits", "peer", "eager", lambda: run(
                lambda hh, ww: naive_logprobs(hh, ww, targets))))
            rows.append(compiled_peer(naive_logprobs, lambda c: run(lambda hh, ww: c(hh, ww, targets)), compile_peers))
            fn, why = _liger("ce")
            runs_as, skip = _triton_rows(device, n * v, "Liger")
            skip = why or skip
            rows.append(Method("Liger fused linear CE", "peer", runs_as, None if skip else lambda fn=fn: run(
                lambda hh, ww: -fn.apply(hh, ww, targets, None, None, -100, 0.0, 0.0, "none")[0].float()), skip))
            grad_bytes = (n * h + v * h) * hidden.element_size() if backward else 0
            return Case(f"{pass_} {dtype_name}", {"N": n, "H": h, "V": v}, dtype_name,
                        (6 if backward else 2) * n * h * v, rows, error, grad_bytes)


def divergence_cases(preset: Preset, device: torch.device, compile_peers: bool = True) -> list:
    """Per token: log p under both contexts and KL(p_skill || p_orig), KL(p_orig || p_skill); fwd+bwd through the
    original context. Liger's fused linear JSD (beta 0 = KL(teacher || student), mean over tokens) is its peer: it
    returns only the mean, so its error is that of the mean forward KL."""
    n, h, v = preset.tokens, preset.hidden, preset.vocab_rank
    return [_divergence_case(n, h, v, dtype_name, device, compile_peers) for dtype_name in
            preset.divergence_dtypes or preset.dtypes]


def _divergence_case(n, h, v, dtype_name, device, compile_peers) -> Case:
    if True:
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

        def run(fn, h_orig=h_orig, h_skill=h_skill, weight=weight):
            ho = h_orig.detach().requires_grad_(True)
            ww = weight.detach().requires_grad_(True)
            out = fn(h_skill, ho, ww)
            if isinstance(out, dict):
                loss = (out["kl_skill_orig"] + out["kl_orig_skill"] + out["logp_orig"]).sum()
                loss.backward()
                return {k: out[k].detach() for k in ref}, ho.grad, ww.grad
            out.backward()
            return {"kl_skill_orig_mean": out.detach()}, None, None

        def error(res, ref=ref):
            outs, gh, gw = res
            if "kl_skill_orig_mean" in outs:
                return {"kl_mean": max_abs(outs["kl_skill_orig_mean"], ref["kl_skill_orig"].mean())}
            e = {k: max_abs(outs[k], ref[k]) for k in ref}
            e["grad_hidden_rel"] = rel_max(gh, ref_gh)
            e["grad_weight_rel"] = rel_max(gw, ref_gw)
            return e

        rows = []
        if device.type == "cuda":
            rows.append(Method("dual_context_divergence", "ours", "Triton", lambda: run(
                lambda hs, ho, ww: dual_context_divergence(hs, ho, ww, targets, backend="triton"))))
        rows.append(Method("dual_context_divergence", "ours", "torch path (chunked)", lambda: run(
            lambda hs, ho, ww: dual_context_divergence(hs, ho, ww, targets, backend="torch"))))
        if device.type != "cuda":
            runs_as, skip = _triton_rows(device, n * v, "dual_context_divergence")
            rows.append(Method("dual_context_divergence", "ours", runs_as, None if skip else lambda: run(
                lambda hs, ho, ww: dual_context_divergence(hs, ho, ww, targets, backend="triton")), skip))
        rows.append(Method("naive two full log-softmaxes", "peer", "eager", lambda: run(
            lambda hs, ho, ww: naive_divergence(hs, ho, ww, targets))))
        rows.append(compiled_peer(naive_divergence, lambda c: run(lambda hs, ho, ww: c(hs, ho, ww, targets)),
                                  compile_peers))
        fn, why = _liger("jsd")
        runs_as, skip = _triton_rows(device, n * v, "Liger")
        skip = why or skip
        rows.append(Method("Liger fused linear JSD (beta 0)", "peer", runs_as, None if skip else lambda fn=fn: run(
            lambda hs, ho, ww: fn.apply(ho, ww, hs, ww.detach(), None, 0.0, -100, 1.0)), skip))
        grad_bytes = (n * h + v * h) * h_orig.element_size()
        return Case(f"fwd+bwd {dtype_name}", {"N": n, "H": h, "V": v}, dtype_name, 10 * n * h * v, rows,
                    error, grad_bytes)


OPS = {
    "logprob": ("token log-probs from hidden states, fwd and fwd+bwd (fused_logprobs)", logprob_cases),
    "divergence": ("dual-context divergence head: log-probs under both contexts and both KLs, fwd+bwd",
                   divergence_cases),
}
