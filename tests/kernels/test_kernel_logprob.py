"""fused_logprobs (torch path and Triton) against the float64 full-logits reference, gradients included."""
import multiprocessing as mp
import os
import tempfile

import pytest
import torch

from opid_mega.kernels import fused_logprobs, logprobs_reference
from opid_mega.kernels._dispatch import resolve_backend
from tolerance import assert_close_scaled

ON_GPU = torch.cuda.is_available()


def _inputs(n, h, v, dtype, device, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * scale).to(dtype).to(device)
    weight = (torch.randn(v, h, generator=g) / h ** 0.5 * 4).to(dtype).to(device)
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    return hidden, weight, targets


def _check_against_reference(hidden, weight, targets, *, backend, entropy, tol_val=1e-5, tol_grad, **kw):
    """tol_val: relative to the largest |log-prob| (the entropy, -Σ p log p, is rounded at the log-probs' size too:
    it is ~0 for peaked distributions); tol_grad: relative to the largest gradient entry (at least 1)."""
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    h64 = hidden.detach().double().cpu().requires_grad_()
    w64 = weight.detach().double().cpu().requires_grad_()
    g = torch.Generator().manual_seed(1)
    g_lp = torch.randn(targets.shape[0], generator=g, dtype=torch.float64)
    g_ent = torch.randn(targets.shape[0], generator=g, dtype=torch.float64)
    if entropy:
        lp, ent = fused_logprobs(h, w, targets, return_entropy=True, backend=backend, **kw)
        rlp, rent = logprobs_reference(h64, w64, targets.cpu(), return_entropy=True)
        assert ent.dtype == torch.float32
        size = max(float(rent.detach().abs().max()), float(rlp.detach().abs().max()))
        assert_close_scaled(ent, rent, rel=tol_val, scale=size, msg="entropy")
        loss = (lp.double().cpu() * g_lp).sum() + (ent.double().cpu() * g_ent).sum()
        ref_loss = (rlp * g_lp).sum() + (rent * g_ent).sum()
    else:
        lp = fused_logprobs(h, w, targets, backend=backend, **kw)
        rlp = logprobs_reference(h64, w64, targets.cpu())
        loss = (lp.double().cpu() * g_lp).sum()
        ref_loss = (rlp * g_lp).sum()
    assert lp.dtype == torch.float32 and lp.shape == targets.shape
    assert_close_scaled(lp, rlp, rel=tol_val, msg="log-probs")
    loss.backward()
    ref_loss.backward()
    assert h.grad.dtype == hidden.dtype and w.grad.dtype == weight.dtype
    for name, got, ref in (("d hidden", h.grad, h64.grad), ("d weight", w.grad, w64.grad)):
        assert_close_scaled(got, ref, rel=tol_grad, floor=1.0, msg=name)


@pytest.mark.parametrize("n,h,v,chunk", [(1, 8, 5, 4096), (37, 24, 1000, 128), (50, 33, 777, 100), (9, 16, 64, 64)])
@pytest.mark.parametrize("entropy", [False, True])
def test_torch_path_matches_reference(n, h, v, chunk, entropy):
    hidden, weight, targets = _inputs(n, h, v, torch.float32, "cpu", seed=n + v)
    _check_against_reference(hidden, weight, targets, backend="torch", entropy=entropy, tol_grad=2e-5,
                             chunk_size=chunk)


def test_torch_path_bf16_and_leading_dims():
    hidden, weight, targets = _inputs(24, 32, 300, torch.bfloat16, "cpu", seed=3)
    _check_against_reference(hidden, weight, targets, backend="torch", entropy=True, tol_grad=1e-2, chunk_size=64)
    lp3 = fused_logprobs(hidden.reshape(4, 6, 32), weight, targets.reshape(4, 6), backend="torch")
    assert lp3.shape == (4, 6)
    assert_close_scaled(lp3.reshape(-1), fused_logprobs(hidden, weight, targets, backend="torch"), msg="[4, 6] rows")


def test_large_logits_are_stable():
    hidden, weight, targets = _inputs(16, 16, 500, torch.float32, "cpu", seed=5, scale=30.0)
    ref = logprobs_reference(hidden, weight, targets)
    assert ref.abs().max() > 100  # really large logits
    _check_against_reference(hidden, weight, targets, backend="torch", entropy=True, tol_grad=1e-4, chunk_size=97)


def test_vocab_shard_offset_and_entropy_only_grad():
    hidden, weight, targets = _inputs(20, 16, 200, torch.float32, "cpu", seed=7)
    start = 1000
    lp = fused_logprobs(hidden, weight, targets + start, vocab_start=start, backend="torch", chunk_size=64)
    assert_close_scaled(lp, logprobs_reference(hidden, weight, targets), msg="shard offset log-probs")
    h = hidden.clone().requires_grad_()
    _, ent = fused_logprobs(h, weight, targets, return_entropy=True, backend="torch", chunk_size=64)
    ent.sum().backward()
    h64 = hidden.double().requires_grad_()
    logits = h64 @ weight.double().t()
    logp = torch.log_softmax(logits, -1)
    (-(logp.exp() * logp).sum(-1)).sum().backward()
    assert_close_scaled(h.grad, h64.grad, msg="entropy-only d hidden")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padded_vocabulary_rows_are_ignored(backend, small_tiles, device):
    hidden, weight, targets = _inputs(19, 16, 150, torch.float32, device, seed=13)
    real = 111
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    lp = fused_logprobs(h, w, targets % real, backend=backend, vocab_size=real)
    lp.sum().backward()
    h64 = hidden.double().cpu().requires_grad_()
    w64 = weight[:real].double().cpu().requires_grad_()
    ref = logprobs_reference(h64, w64, (targets % real).cpu())
    ref.sum().backward()
    assert_close_scaled(lp, ref, msg="log-probs")
    assert_close_scaled(h.grad, h64.grad, msg="d hidden")
    assert_close_scaled(w.grad[:real], w64.grad, msg="d weight")
    assert w.grad[real:].abs().max() == 0
    with pytest.raises(ValueError, match="outside the vocabulary"):
        fused_logprobs(hidden, weight, torch.full_like(targets, real), backend=backend, vocab_size=real)


def test_bad_input_errors():
    hidden, weight, targets = _inputs(4, 8, 10, torch.float32, "cpu")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        fused_logprobs(hidden, weight, targets + 10, backend="torch")
    with pytest.raises(ValueError, match="weight must be"):
        fused_logprobs(hidden, weight[:, :4], targets, backend="torch")
    with pytest.raises(ValueError, match="targets shape"):
        fused_logprobs(hidden, weight, targets[:2], backend="torch")
    with pytest.raises(ValueError, match="dtype"):
        fused_logprobs(hidden, weight.double(), targets, backend="torch")
    with pytest.raises(ValueError, match="backend"):
        fused_logprobs(hidden, weight, targets, backend="cuda")


def test_backend_resolution(monkeypatch):
    x = torch.zeros(1)
    monkeypatch.delenv("OPID_TRITON_INTERPRET", raising=False)
    assert resolve_backend("auto", x, "k") == ("triton" if x.is_cuda else "torch")
    assert resolve_backend("torch", x, "k") == "torch"
    monkeypatch.setenv("OPID_TRITON_INTERPRET", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("auto", x, "k") == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert resolve_backend("auto", x, "k") == "torch"
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        resolve_backend("triton", x, "k")


# ---------------------------------------------------------------------------------------------- Triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk", [None, 64])
def test_triton_matches_reference(dtype, chunk, small_tiles, device):
    """One chunk of the whole vocabulary (None at these sizes) and four (64 columns), several splits in each."""
    hidden, weight, targets = _inputs(37, 40, 200, dtype, device, seed=11)
    fp32 = dtype == torch.float32
    _check_against_reference(hidden, weight, targets, backend="triton", entropy=True, chunk_size=chunk,
                             tol_val=1e-5 if fp32 else 2e-5, tol_grad=2e-5 if fp32 else 2e-2)


@pytest.mark.parametrize("saved,recomputed", [(0, 4), (None, 3), (1 << 30, 0)])
def test_triton_backward_recomputes_only_the_chunks_it_did_not_keep(saved, recomputed, small_tiles, device,
                                                                     monkeypatch):
    """saved_logits_bytes: 0 recomputes all 4 chunks' logits in the backward, the default keeps the last one, a budget
    that holds them all recomputes none; the gradients are the float64 reference's every time. fp32 GEMMs counted:
    one per chunk forward, one per recomputed chunk, one per chunk for grad_hidden (the weight gradient's GEMM writes
    into its rows directly)."""
    calls = []
    real = small_tiles.mm_fp32
    monkeypatch.setattr(small_tiles, "mm_fp32", lambda a, b: calls.append(a.shape) or real(a, b))
    hidden, weight, targets = _inputs(19, 24, 200, torch.float32, device, seed=17)
    _check_against_reference(hidden, weight, targets, backend="triton", entropy=True, chunk_size=64,
                             saved_logits_bytes=saved, tol_grad=2e-5)
    assert len(calls) == 4 + recomputed + 4


def test_triton_logprob_only_and_single_row(small_tiles, device):
    for n, v in ((1, 7), (17, 130)):
        hidden, weight, targets = _inputs(n, 20, v, torch.float32, device, seed=n)
        _check_against_reference(hidden, weight, targets, backend="triton", entropy=False, tol_grad=2e-5)


@pytest.mark.gpu
@pytest.mark.autotune
@pytest.mark.skipif(not ON_GPU, reason="the autotuner runs on a GPU only (the interpreter has no timer)")
def test_autotuned_heads_and_fork_attention_match_the_reference(device):
    """With the autotuner on (the kernels' production path), at a shape where the tuned tiles differ from the
    fixed ones: the log-prob head, the divergence head and fork attention still match their float64 references."""
    from opid_mega.kernels import divergence_reference, dual_context_divergence, fork_attention
    from opid_mega.kernels.fork_attention import fork_attention_reference

    hidden, weight, targets = _inputs(300, 64, 3000, torch.bfloat16, device, seed=23)
    _check_against_reference(hidden, weight, targets, backend="triton", entropy=True, chunk_size=1024, tol_val=2e-5,
                             tol_grad=2e-2)
    out = dual_context_divergence(hidden.flip(0), hidden, weight, targets, topk=8, backend="triton", chunk_size=1024)
    ref = divergence_reference(hidden.flip(0).cpu(), hidden.cpu(), weight.cpu(), targets.cpu(), topk=8)
    scale = float(ref["logp_orig"].abs().max())
    for k in ("logp_skill", "logp_orig", "kl_skill_orig", "kl_orig_skill", "topk_logp_skill"):
        assert_close_scaled(out[k], ref[k], rel=2e-5, scale=scale, msg=k)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(700, h, 64, generator=g).to(torch.bfloat16).to(device) for h in (8, 2, 2))
    cu = torch.tensor([0, 400, 700], dtype=torch.int32, device=device)
    bid = torch.tensor([0] * 200 + [1] * 120 + [2] * 80 + [0] * 100 + [1] * 200, dtype=torch.int32, device=device)
    assert_close_scaled(fork_attention(q, k, v, cu, bid, backend="triton"),
                        fork_attention_reference(q.cpu(), k.cpu(), v.cpu(), cu.cpu(), bid.cpu()), rel=2 * 2 ** -7)


@pytest.mark.skipif(ON_GPU, reason="CPU-interpreter dispatch check")
def test_auto_backend_uses_triton_under_interpreter(small_tiles, monkeypatch):
    import opid_mega.kernels.logprob_triton as lt
    calls = []
    real = lt.local_partials
    monkeypatch.setattr(lt, "local_partials", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("OPID_TRITON_INTERPRET", "1")
    hidden, weight, targets = _inputs(5, 16, 40, torch.float32, "cpu")
    lp = fused_logprobs(hidden, weight, targets)
    assert calls == [1]
    assert_close_scaled(lp, logprobs_reference(hidden, weight, targets))


# ---------------------------------------------------------------------------------------------- TP2 (gloo)
N_TP, H_TP, V_TP = 23, 16, 203  # uneven shards: 101 + 102
PAD_VOCAB = 101  # for the padded-vocabulary case: rank 1 holds only padding rows


def _tp_backends():
    # the ranks run on CPU tensors: the Triton half needs the interpreter there (absent on a GPU run of the suite)
    return ["torch", "triton"] if os.environ.get("TRITON_INTERPRET") == "1" else ["torch"]


def _tp_worker(rank, world, init_file, out_dir):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        hidden, weight, targets = _inputs(N_TP, H_TP, V_TP, torch.float32, "cpu", seed=42)
        bounds = [0, 101, V_TP]
        lo, hi = bounds[rank], bounds[rank + 1]
        results = {}
        for backend in _tp_backends():
            if backend == "triton":
                import opid_mega.kernels.logprob_triton as lt
                lt.BLOCK_N, lt.BLOCK_V, lt.SPLIT = 8, 16, 32
            h = hidden.clone().requires_grad_()
            w = weight[lo:hi].clone().requires_grad_()
            lp, ent = fused_logprobs(h, w, targets, vocab_start=lo, tp_group=dist.group.WORLD, return_entropy=True,
                                     backend=backend, chunk_size=37)
            g = torch.Generator().manual_seed(1)
            (lp * torch.randn(N_TP, generator=g)).sum().add((ent * torch.randn(N_TP, generator=g)).sum()).backward()
            results[backend] = (lp.detach(), ent.detach(), h.grad, w.grad)
            # Megatron-style vocabulary padding: only ids < PAD_VOCAB are real; rank 1's shard is all padding
            h = hidden.clone().requires_grad_()
            w = weight[lo:hi].clone().requires_grad_()
            lp = fused_logprobs(h, w, targets % PAD_VOCAB, vocab_start=lo, tp_group=dist.group.WORLD, backend=backend,
                                vocab_size=PAD_VOCAB, chunk_size=37)
            lp.sum().backward()
            results[backend + "_padded"] = (lp.detach(), h.grad, w.grad)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_vocab_parallel_tp2_equals_full_vocab():
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_tp_worker, args=(r, 2, init_file, tmp)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
        for p in procs:
            if p.is_alive():
                p.kill()
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        res = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(2)]
    hidden, weight, targets = _inputs(N_TP, H_TP, V_TP, torch.float32, "cpu", seed=42)
    h64 = hidden.double().requires_grad_()
    w64 = weight.double().requires_grad_()
    rlp, rent = logprobs_reference(h64, w64, targets, return_entropy=True)
    g = torch.Generator().manual_seed(1)
    ((rlp * torch.randn(N_TP, generator=g).double()).sum()
     + (rent * torch.randn(N_TP, generator=g).double()).sum()).backward()
    for backend in _tp_backends():
        for r, (lo, hi) in enumerate(((0, 101), (101, V_TP))):
            lp, ent, gh, gw = res[r][backend]
            assert_close_scaled(lp, rlp, msg=f"{backend} rank {r} log-probs")
            assert_close_scaled(ent, rent, msg=f"{backend} rank {r} entropy")
            assert_close_scaled(gh, h64.grad, msg=f"{backend} rank {r} d hidden")  # all-reduced: the full gradient
            assert_close_scaled(gw, w64.grad[lo:hi], msg=f"{backend} rank {r} d weight shard")
    hp = hidden.double().requires_grad_()
    wp = weight[:PAD_VOCAB].double().requires_grad_()
    rlp = logprobs_reference(hp, wp, targets % PAD_VOCAB)
    rlp.sum().backward()
    for backend in _tp_backends():
        lp0, gh0, gw0 = res[0][backend + "_padded"]
        lp1, gh1, gw1 = res[1][backend + "_padded"]
        assert_close_scaled(lp0, rlp, msg=f"{backend} padded log-probs")
        assert_close_scaled(lp1, lp0, msg="rank 1 vs rank 0")  # both ranks hold the all-reduced result
        assert_close_scaled(gh0, hp.grad, msg=f"{backend} padded d hidden")
        assert_close_scaled(gh1, gh0, msg="rank 1 vs rank 0 d hidden")
        assert_close_scaled(gw0, wp.grad, msg=f"{backend} padded d weight")
        assert gw1.abs().max() == 0  # padding rows get no gradient


def test_package_import_needs_no_triton():
    import subprocess
    import sys
    code = "import sys, opid_mega.kernels as k; assert 'triton' not in sys.modules; print(k.fused_logprobs.__name__)"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and "fused_logprobs" in proc.stdout, proc.stderr[-2000:]
