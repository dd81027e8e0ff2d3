"""fused_logprobs at a sampling temperature T: log-probs, entropy and gradients equal a float64
log_softmax(hidden @ W^T / T) reference (OPID.md "Reference rules in detail": log-probs are computed at the sampling
temperature, logits / T), on the torch path and the Triton path (CPU interpreter, small shapes); T = 1 is the
default call, bit for bit."""
import pytest
import torch

from opid_mega.kernels import fused_logprobs
from tolerance import assert_close_scaled


def _inputs(n, h, v, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) / h ** 0.5 * 4
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, targets


def _reference(hidden, weight, targets, temperature):
    """float64: log p = log_softmax(h W^T / T), entropy of that distribution, and their gradients."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    logp = torch.log_softmax((h @ w.t()) / temperature, dim=-1)
    lp = logp.gather(-1, targets[:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return h, w, lp, ent


def _check(backend, n, h, v, temperature, seed, device="cpu", tol=1e-5, tol_grad=2e-5):
    """fp32 kernel vs float64: values within `tol` of the largest |log-prob| / entropy, gradients within `tol_grad`
    of the largest gradient entry (at least 1)."""
    hidden, weight, targets = _inputs(n, h, v, seed)
    g = torch.Generator().manual_seed(seed + 1)
    g_lp, g_ent = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)
    hh = hidden.detach().clone().to(device).requires_grad_()
    ww = weight.detach().clone().to(device).requires_grad_()
    lp, ent = fused_logprobs(hh, ww, targets.to(device), return_entropy=True, backend=backend,
                             temperature=temperature, chunk_size=37)
    ((lp.double().cpu() * g_lp).sum() + (ent.double().cpu() * g_ent).sum()).backward()
    rh, rw, rlp, rent = _reference(hidden, weight, targets, temperature)
    ((rlp * g_lp).sum() + (rent * g_ent).sum()).backward()
    assert_close_scaled(lp, rlp, rel=tol, msg="log-probs")
    assert_close_scaled(ent, rent, rel=tol, msg="entropy")
    assert_close_scaled(hh.grad, rh.grad, rel=tol_grad, floor=1.0, msg="d hidden")
    assert_close_scaled(ww.grad, rw.grad, rel=tol_grad, floor=1.0, msg="d weight")
    return lp.detach().cpu()


@pytest.mark.parametrize("temperature", [0.7, 0.4, 1.6])
def test_torch_path_at_temperature_matches_float64_reference(temperature):
    lp = _check("torch", 29, 24, 300, temperature, seed=3)
    # the temperature changes the numbers (the reference at T=1 is far away)
    hidden, weight, targets = _inputs(29, 24, 300, 3)
    plain = torch.log_softmax(hidden.double() @ weight.double().t(), -1).gather(-1, targets[:, None]).squeeze(-1)
    assert (lp.double() - plain).abs().max() > 1e-2


def test_triton_path_at_temperature_matches_reference_and_torch(small_tiles, device):
    lp_tri = _check("triton", 19, 20, 150, 0.7, seed=5, device=device)
    hidden, weight, targets = _inputs(19, 20, 150, 5)
    lp_torch = fused_logprobs(hidden, weight, targets, backend="torch", temperature=0.7)
    assert_close_scaled(lp_tri, lp_torch, msg="triton vs torch")  # two fp32 paths: 1e-5 of the largest |log-prob|


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_temperature_one_is_the_default_bit_for_bit(backend, small_tiles, device):
    hidden, weight, targets = _inputs(13, 16, 90, 9)
    outs = []
    for kw in ({}, {"temperature": 1.0}, {"temperature": 1}):
        h = hidden.detach().clone().to(device).requires_grad_()
        lp, ent = fused_logprobs(h, weight.to(device), targets.to(device), return_entropy=True, backend=backend, **kw)
        (lp.sum() + ent.sum()).backward()
        outs.append((lp.detach(), ent.detach(), h.grad))
    for got in outs[1:]:
        for a, b in zip(got, outs[0]):
            assert torch.equal(a, b)


def test_vocab_shard_offset_at_temperature():
    hidden, weight, targets = _inputs(11, 16, 120, 21)
    lp = fused_logprobs(hidden, weight, targets + 500, vocab_start=500, backend="torch", temperature=0.5)
    _, _, rlp, _ = _reference(hidden, weight, targets, 0.5)
    assert_close_scaled(lp, rlp, msg="shard offset log-probs")


@pytest.mark.parametrize("bad", [0.0, -0.7, float("nan"), float("inf")])
def test_bad_temperature_is_a_clear_error(bad):
    hidden, weight, targets = _inputs(3, 8, 10, 0)
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        fused_logprobs(hidden, weight, targets, backend="torch", temperature=bad)


def _tp2_worker(rank, init_file, out_dir):
    import os

    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        hidden, weight, targets = _inputs(17, 16, 101, 31)
        lo, hi = (0, 50) if rank == 0 else (50, 101)  # uneven vocabulary shards
        h = hidden.clone().requires_grad_()
        w = weight[lo:hi].clone().requires_grad_()
        lp, ent = fused_logprobs(h, w, targets, vocab_start=lo, tp_group=dist.group.WORLD, return_entropy=True,
                                 backend="torch", temperature=0.7, chunk_size=13)
        (lp.sum() + 0.5 * ent.sum()).backward()
        torch.save((lp.detach(), ent.detach(), h.grad, w.grad), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_vocab_parallel_tp2_at_temperature():
    """The vocabulary-parallel head (max / sum-exp / target all-reduced over 2 shards) at T = 0.7."""
    import multiprocessing as mp
    import os
    import tempfile

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_tp2_worker, args=(r, os.path.join(tmp, "init"), tmp)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
            if p.is_alive():
                p.kill()
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        res = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(2)]
    hidden, weight, targets = _inputs(17, 16, 101, 31)
    rh, rw, rlp, rent = _reference(hidden, weight, targets, 0.7)
    (rlp.sum() + 0.5 * rent.sum()).backward()
    for r, (lo, hi) in enumerate(((0, 50), (50, 101))):
        lp, ent, gh, gw = res[r]
        assert_close_scaled(lp, rlp, msg=f"rank {r} log-probs")
        assert_close_scaled(ent, rent, msg=f"rank {r} entropy")
        assert_close_scaled(gh, rh.grad, msg=f"rank {r} d hidden")
        assert_close_scaled(gw, rw.grad[lo:hi], msg=f"rank {r} d weight shard")
