"""dual_context_divergence (torch path and Triton under the interpreter) against a float64 full-logits reference:
values within 1e-5 of their magnitude (log-probs: the largest |log-prob|; KLs, differences of log-probs: the
largest |log-prob| they come from), gradients w.r.t. h_orig and the weight within 1e-4 of the largest entry, TP1 and
TP2 (gloo)."""
import multiprocessing as mp
import os
import tempfile

import pytest
import torch

from opid_mega.kernels import divergence_reference, dual_context_divergence, fused_logprobs
from tolerance import assert_close_scaled

ON_GPU = torch.cuda.is_available()
DIFF_KEYS = ("logp_orig", "kl_skill_orig", "kl_orig_skill")
VALUE_KEYS = ("logp_skill",) + DIFF_KEYS
TOL_VAL, TOL_GRAD = 1e-5, 1e-4  # relative (see _scale / floor 1 for gradients)


def _scale(ref, k):
    """The magnitude output `k` is rounded at: its own largest entry, and for a KL (a difference of log-probs,
    itself small) the largest |log-prob| of the two contexts."""
    own = float(ref[k].detach().abs().max())
    if k.startswith("kl_"):
        return max(own, float(ref["logp_orig"].detach().abs().max()), float(ref["logp_skill"].detach().abs().max()))
    return own


def _close(out, ref, keys, rel=TOL_VAL, msg=""):
    for k in keys:
        assert_close_scaled(out[k], ref[k], rel=rel, scale=_scale(ref, k), msg=f"{msg} {k}".strip())


def _inputs(n, h, v, seed=0, dtype=torch.float32, close=0.5):
    """Two contexts whose hidden rows are correlated (like a skill section that shifts the distribution a bit)."""
    g = torch.Generator().manual_seed(seed)
    h_orig = torch.randn(n, h, generator=g)
    h_skill = h_orig + close * torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) / h ** 0.5 * 3
    targets = torch.randint(0, v, (n,), generator=g)
    return h_skill.to(dtype), h_orig.to(dtype), weight.to(dtype), targets


@pytest.fixture
def tri_tiles(shrink_tiles):
    """Under the interpreter, small Triton tiles so tiny shapes still run multi-tile loops and several splits."""
    import opid_mega.kernels.dual_context_divergence_triton as dt

    return shrink_tiles(dt)


def _grad_weights(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(n, generator=g, dtype=torch.float64) for k in DIFF_KEYS}


def _check(h_skill, h_orig, weight, targets, *, backend, topk=0, temperature=1.0, device="cpu", keys=DIFF_KEYS,
           **kw):
    """Kernel vs float64 reference: every value, the top-k, and the gradients of sum_k g_k * out_k."""
    hs = h_skill.detach().clone().to(device).requires_grad_()
    ho = h_orig.detach().clone().to(device).requires_grad_()
    w = weight.detach().clone().to(device).requires_grad_()
    out = dual_context_divergence(hs, ho, w, targets.to(device), backend=backend, topk=topk, temperature=temperature,
                                  **kw)
    ho64 = h_orig.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    ref = divergence_reference(h_skill.detach().double(), ho64, w64, targets, topk=topk, temperature=temperature)
    for k in VALUE_KEYS:
        assert out[k].dtype == torch.float32 and out[k].shape == targets.shape, k
    _close(out, ref, VALUE_KEYS)
    if topk:
        assert torch.equal(out["topk_ids"].cpu(), ref["topk_ids"])
        _close(out, ref, ("topk_logp_skill", "topk_logp_orig", "topk_mass"))
    gw = _grad_weights(targets.shape[0])
    sum((out[k].double().cpu() * gw[k]).sum() for k in keys).backward()
    sum((ref[k] * gw[k]).sum() for k in keys).backward()
    assert hs.grad is None  # the skill side is stop-gradient
    for name, got, want in (("d h_orig", ho.grad, ho64.grad), ("d weight", w.grad, w64.grad)):
        assert got.dtype == h_orig.dtype
        assert_close_scaled(got, want, rel=TOL_GRAD, floor=1.0, msg=name)
    return {k: v.detach().cpu() for k, v in out.items()}


# ---------------------------------------------------------------------------------------------- torch path
@pytest.mark.parametrize("n,h,v,chunk,topk", [(1, 8, 5, 4096, 0), (37, 24, 1000, 128, 7), (50, 33, 777, 100, 16),
                                              (9, 16, 64, 64, 64)])
def test_torch_path_matches_float64_reference(n, h, v, chunk, topk):
    _check(*_inputs(n, h, v, seed=n + v), backend="torch", topk=topk, chunk_size=chunk)


@pytest.mark.parametrize("keys", [("logp_orig",), ("kl_skill_orig",), ("kl_orig_skill",)])
def test_each_output_gradient_alone(keys):
    _check(*_inputs(21, 16, 300, seed=4), backend="torch", chunk_size=70, keys=keys)


def test_temperature_and_shard_offset():
    hs, ho, w, tg = _inputs(19, 20, 300, seed=8)
    out = _check(hs, ho, w, tg, backend="torch", temperature=0.6, topk=5, chunk_size=64)
    plain = divergence_reference(hs, ho, w, tg)["kl_orig_skill"]
    assert (out["kl_orig_skill"].double() - plain).abs().max() > 1e-3  # T changes the numbers
    shifted = dual_context_divergence(hs, ho, w, tg + 1000, vocab_start=1000, backend="torch", topk=5,
                                      temperature=0.6, chunk_size=64)
    _close(shifted, out, VALUE_KEYS + ("topk_logp_skill", "topk_mass"), rel=1e-6, msg="shard offset")  # same path
    assert torch.equal(shifted["topk_ids"], out["topk_ids"] + 1000)


def test_matches_fused_logprobs_and_identical_contexts_give_zero_kl():
    hs, ho, w, tg = _inputs(17, 16, 250, seed=2)
    out = dual_context_divergence(hs, ho, w, tg, backend="torch", chunk_size=60)
    assert_close_scaled(out["logp_orig"], fused_logprobs(ho, w, tg, backend="torch", chunk_size=60), msg="orig")
    assert_close_scaled(out["logp_skill"], fused_logprobs(hs, w, tg, backend="torch", chunk_size=60), msg="skill")
    same = dual_context_divergence(ho, ho, w, tg, backend="torch", chunk_size=60)
    for k in ("kl_skill_orig", "kl_orig_skill"):  # 0 up to fp32 rounding of the log-probs (1e-7 of their size)
        assert_close_scaled(same[k], torch.zeros_like(same[k]), rel=1e-7, scale=_scale(same, k), msg=k)
    assert (out["kl_skill_orig"] > 0).all() and (out["kl_orig_skill"] > 0).all()


def test_large_logits_and_bf16_and_leading_dims():
    hs, ho, w, tg = _inputs(16, 16, 500, seed=5)
    ref = divergence_reference(hs * 20, ho * 20, w, tg)
    assert ref["logp_orig"].abs().max() > 100  # really large logits
    out = dual_context_divergence(hs * 20, ho * 20, w, tg, backend="torch", chunk_size=97)
    _close(out, ref, VALUE_KEYS, msg="large logits")  # fp32 rounding of logits ~1e3: relative to their size
    b = [x.bfloat16() for x in (hs, ho, w)]
    out16 = dual_context_divergence(*b, tg, backend="torch", chunk_size=64)
    ref16 = divergence_reference(*b, tg)
    _close(out16, ref16, VALUE_KEYS, msg="bf16 inputs")
    out3 = dual_context_divergence(hs.reshape(4, 4, 16), ho.reshape(4, 4, 16), w, tg.reshape(4, 4), topk=3,
                                   backend="torch")
    assert out3["kl_orig_skill"].shape == (4, 4) and out3["topk_ids"].shape == (4, 4, 3)
    flat = dual_context_divergence(hs, ho, w, tg, backend="torch")
    assert_close_scaled(out3["kl_orig_skill"].reshape(-1), flat["kl_orig_skill"], scale=_scale(flat, "kl_orig_skill"))


def test_padded_vocabulary_rows_are_ignored():
    hs, ho, w, tg = _inputs(11, 16, 150, seed=13)
    real = 111
    wv = w.clone().requires_grad_()
    out = dual_context_divergence(hs, ho, wv, tg % real, backend="torch", vocab_size=real, topk=4, chunk_size=50)
    ref = divergence_reference(hs, ho, w[:real], tg % real, topk=4)
    _close(out, ref, VALUE_KEYS)
    assert int(out["topk_ids"].max()) < real
    (out["kl_orig_skill"].sum() + out["logp_orig"].sum()).backward()
    assert wv.grad[real:].abs().max() == 0


def test_bad_input_errors():
    hs, ho, w, tg = _inputs(4, 8, 10)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        dual_context_divergence(hs, ho, w, tg + 10, backend="torch")
    with pytest.raises(ValueError, match="h_skill shape"):
        dual_context_divergence(hs[:2], ho, w, tg, backend="torch")
    with pytest.raises(ValueError, match="weight must be"):
        dual_context_divergence(hs, ho, w[:, :4], tg, backend="torch")
    with pytest.raises(ValueError, match="share one dtype"):
        dual_context_divergence(hs.double(), ho, w, tg, backend="torch")
    with pytest.raises(ValueError, match="topk"):
        dual_context_divergence(hs, ho, w, tg, topk=-1, backend="torch")
    with pytest.raises(ValueError, match="larger than the vocabulary"):
        dual_context_divergence(hs, ho, w, tg, topk=11, backend="torch")
    with pytest.raises(ValueError, match="temperature"):
        dual_context_divergence(hs, ho, w, tg, temperature=0, backend="torch")
    with pytest.raises(ValueError, match="backend"):
        dual_context_divergence(hs, ho, w, tg, backend="cuda")


# ---------------------------------------------------------------------------------------------- Triton
@pytest.mark.parametrize("chunk,topk,temperature,saved", [(None, 0, 1.0, None), (64, 5, 0.7, 0), (48, 3, 1.0, 1 << 30)])
def test_triton_matches_float64_reference(tri_tiles, device, chunk, topk, temperature, saved):
    """One chunk and several (splits inside each); the backward recomputing every chunk (saved 0), reusing the last
    one (default) and every one (saved: all of them)."""
    out = _check(*_inputs(37, 40, 200, seed=11), backend="triton", topk=topk, temperature=temperature, device=device,
                 chunk_size=chunk, saved_logits_bytes=saved)
    torch_out = dual_context_divergence(*_inputs(37, 40, 200, seed=11), backend="torch", topk=topk,
                                        temperature=temperature)
    _close(out, torch_out, VALUE_KEYS, msg="triton vs torch")


def test_triton_single_row_tiny_vocab_and_bf16(tri_tiles, device):
    _check(*_inputs(1, 20, 7, seed=1), backend="triton", topk=7, device=device)
    hs, ho, w, tg = _inputs(13, 24, 90, seed=6, dtype=torch.bfloat16)
    out = dual_context_divergence(hs.to(device), ho.to(device), w.to(device), tg.to(device), backend="triton")
    ref = divergence_reference(hs, ho, w, tg)
    _close(out, ref, VALUE_KEYS, msg="triton bf16")


# ---------------------------------------------------------------------------------------------- TP2 (gloo)
N_TP, H_TP, V_TP, K_TP = 23, 16, 203, 6  # uneven shards: 101 + 102


def _tp_backends():
    # the ranks run on CPU tensors: the Triton half needs the interpreter there (absent on a GPU run of the suite)
    return ["torch", "triton"] if os.environ.get("TRITON_INTERPRET") == "1" else ["torch"]


def _tp_worker(rank, world, init_file, out_dir):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        hs, ho, w, tg = _inputs(N_TP, H_TP, V_TP, seed=42)
        lo, hi = (0, 101) if rank == 0 else (101, V_TP)
        results = {}
        for backend in _tp_backends():
            if backend == "triton":
                import opid_mega.kernels.dual_context_divergence_triton as dt
                dt.BLOCK_N, dt.BLOCK_V, dt.SPLIT = 8, 16, 32
            h = ho.clone().requires_grad_()
            wl = w[lo:hi].clone().requires_grad_()
            out = dual_context_divergence(hs, h, wl, tg, vocab_start=lo, tp_group=dist.group.WORLD, topk=K_TP,
                                          backend=backend, chunk_size=37, temperature=0.8)
            gw = _grad_weights(N_TP)
            sum((out[k].double() * gw[k]).sum() for k in DIFF_KEYS).backward()
            results[backend] = ({k: v.detach() for k, v in out.items()}, h.grad, wl.grad)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_vocab_parallel_tp2_equals_tp1_and_reference():
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_tp_worker, args=(r, 2, init_file, tmp)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=300)
        for p in procs:
            if p.is_alive():
                p.kill()
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        res = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(2)]
    hs, ho, w, tg = _inputs(N_TP, H_TP, V_TP, seed=42)
    tp1 = dual_context_divergence(hs, ho, w, tg, topk=K_TP, backend="torch", temperature=0.8)
    ho64 = ho.double().requires_grad_()
    w64 = w.double().requires_grad_()
    ref = divergence_reference(hs.double(), ho64, w64, tg, topk=K_TP, temperature=0.8)
    gw = _grad_weights(N_TP)
    sum((ref[k] * gw[k]).sum() for k in DIFF_KEYS).backward()
    for backend in _tp_backends():
        for r, (lo, hi) in enumerate(((0, 101), (101, V_TP))):
            out, gh, gwt = res[r][backend]
            keys = VALUE_KEYS + ("topk_logp_skill", "topk_logp_orig", "topk_mass")
            _close(out, ref, keys, msg=f"{backend} rank {r}")
            _close(out, tp1, keys, msg=f"{backend} rank {r} TP2 = TP1")
            assert torch.equal(out["topk_ids"], ref["topk_ids"])
            # all-reduced: the full gradient
            assert_close_scaled(gh, ho64.grad, rel=TOL_GRAD, floor=1.0, msg=f"{backend} rank {r} d h_orig")
            assert_close_scaled(gwt, w64.grad[lo:hi], rel=TOL_GRAD, floor=1.0, msg=f"{backend} rank {r} d weight")
