"""The output-layer weight gradient of the fused heads (log-prob and dual-context divergence) for a bf16 weight with
an fp32 ``main_grad`` (megatron DDP, grad_reduce_in_fp32) is accumulated into main_grad in fp32 -- as megatron's
gradient_accumulation_fusion does -- not returned in bf16 and rounded per micro-batch. Triton (interpreter here)
and torch paths, bf16 inputs, against float64 references; DDP's hook (main_grad += param.grad) is replayed so a
second use of the same weight (the tied input embedding) still counts."""
import pytest
import torch
import torch.nn.functional as F

from opid_mega.kernels import dual_context_divergence, fused_logprobs, logprobs_reference

N, H, V = 40, 48, 200


def _param(seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g).bfloat16()
    w = torch.nn.Parameter((torch.randn(V, H, generator=g) / H ** 0.5 * 4).bfloat16())
    targets = torch.randint(0, V, (N,), generator=g)
    return hidden, w, targets, g


def _ddp_hook(w):
    """What megatron's DDP does after the backward: main_grad += param.grad; param.grad = None."""
    w.main_grad.add_(w.grad.float())
    w.grad = None


def _err(got, ref):
    return float((got.double() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_logprob_head_weight_grad_goes_to_main_grad_in_fp32(backend, shrink_tiles, device):
    if backend == "triton":
        import opid_mega.kernels.logprob_triton as lt

        shrink_tiles(lt)
    hidden, w, targets, g = _param(0)
    hidden, targets = hidden.to(device), targets.to(device)
    w = torch.nn.Parameter(w.detach().to(device))
    g_lp, g_ent = torch.randn(N, generator=g, dtype=torch.float64), torch.randn(N, generator=g, dtype=torch.float64)
    start = torch.randn(V, H, generator=g)  # what earlier micro-batches accumulated
    w.main_grad = start.clone().to(device)

    h64, w64 = hidden.double().cpu(), w.detach().double().cpu().requires_grad_()
    rlp, rent = logprobs_reference(h64, w64, targets.cpu(), return_entropy=True)
    ((rlp * g_lp).sum() + (rent * g_ent).sum()).backward()
    ref = w64.grad

    lp, ent = fused_logprobs(hidden, w, targets, return_entropy=True, backend=backend, chunk_size=64)  # 4 chunks
    ((lp.double().cpu() * g_lp).sum() + (ent.double().cpu() * g_ent).sum()).backward()
    assert w.grad.dtype == torch.bfloat16 and not w.grad.any()  # autograd's share: zero
    _ddp_hook(w)
    got = (w.main_grad.cpu() - start).double()
    err = _err(got, ref)

    # the same weight without main_grad: the gradient comes back in bf16 (what main_grad received before)
    w_old = torch.nn.Parameter(w.detach().clone())
    lp, ent = fused_logprobs(hidden, w_old, targets, return_entropy=True, backend=backend, chunk_size=64)
    ((lp.double().cpu() * g_lp).sum() + (ent.double().cpu() * g_ent).sum()).backward()
    err_bf16 = _err(w_old.grad.cpu(), ref)
    # torch path: d logits in fp32; Triton: d logits tiles as two bf16 parts (hi + lo), products accumulated and
    # kept in fp32 -- both at fp32 rounding, far inside the bf16 rounding of the returned w.grad
    assert err <= 2e-5, (err, err_bf16)
    assert err * 20 < err_bf16, (err, err_bf16)


def test_tied_weight_keeps_both_gradients(device):
    """The output weight is also the input embedding (tied, one pipeline stage): the embedding's gradient reaches
    main_grad through DDP's hook, the head's directly; together they equal the float64 gradient of both uses."""
    hidden, w, targets, g = _param(1)
    ids = torch.randint(0, V, (N,), generator=g)
    w = torch.nn.Parameter(w.detach().to(device))
    w.main_grad = torch.zeros(V, H, device=device)
    emb_w = torch.randn(N, H, generator=g, dtype=torch.float64)

    w64 = w.detach().double().cpu().requires_grad_()
    logprobs_reference(hidden.double(), w64, targets).sum().backward()
    head_only = w64.grad.clone()
    (F.embedding(ids, w64) * emb_w).sum().backward()

    lp = fused_logprobs(hidden.to(device), w, targets.to(device), backend="torch")
    (lp.double().cpu().sum() + (F.embedding(ids.to(device), w).double().cpu() * emb_w).sum()).backward()
    _ddp_hook(w)
    assert _err(w.main_grad.cpu(), w64.grad) <= 4e-3  # the embedding part arrives in bf16 (its own autograd)
    assert _err(w.main_grad.cpu(), head_only) > 0.1  # ... and it did arrive


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_divergence_head_weight_grad_goes_to_main_grad_in_fp32(backend, shrink_tiles, device):
    if backend == "triton":
        import opid_mega.kernels.dual_context_divergence_triton as dt

        shrink_tiles(dt)
    hidden, w, targets, g = _param(2)
    h_skill = torch.randn(N, H, generator=g).bfloat16()
    w = torch.nn.Parameter(w.detach().to(device))
    w.main_grad = torch.zeros(V, H, device=device)
    g_kl = torch.randn(N, generator=g, dtype=torch.float64)

    w64 = w.detach().double().cpu().requires_grad_()
    lo = torch.log_softmax(hidden.double() @ w64.t(), -1)
    ls = torch.log_softmax(h_skill.double() @ w64.detach().t(), -1)
    ref_kl = (ls.exp() * (ls - lo)).sum(-1)  # KL(p_skill || p_orig): gradient through the original rows only
    (ref_kl * g_kl).sum().backward()

    out = dual_context_divergence(h_skill.to(device), hidden.to(device), w, targets.to(device), backend=backend,
                                  chunk_size=64)
    kl = out["kl_skill_orig"].detach().double().cpu()
    assert float((kl - ref_kl).abs().max()) <= 2e-4 * float(ref_kl.abs().max())
    (out["kl_skill_orig"].double().cpu() * g_kl).sum().backward()
    assert not w.grad.any()
    _ddp_hook(w)
    err = _err(w.main_grad.cpu(), w64.grad)
    assert err <= 2e-5, err
