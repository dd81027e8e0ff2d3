"""fork_attention (torch per-segment path and Triton) == naive causal passes over the unpacked sequences."""
import math
import random

import pytest
import torch

from opid_mega.kernels import fork_attention, fork_attention_reference
from opid_mega.kernels.fork_attention import build_fork_metadata
from tolerance import assert_close_scaled

ON_GPU = torch.cuda.is_available()
# output vs the float64 reference, relative to the largest |output| (~3): fp32 1e-5; 16-bit: 2 ulps of the max
# (bf16 ulp 2^-7 = 7.8e-3 of the magnitude, fp16 2^-10): the output is rounded once, and the Triton kernel also rounds
# the probabilities to the input dtype before P @ V (measured: bf16 Triton 0.9 ulp, the others <= 0.4 ulp)
REL = {torch.float32: 1e-5, torch.bfloat16: 2 * 2 ** -7, torch.float16: 2 * 2 ** -10}


def _pack(groups):
    """groups: list of (prefix_len, [branch_len, ...]) -> (cu_seqlens, branch_ids) with branch ids 1..B."""
    ids, cu = [], [0]
    for p, branches in groups:
        ids += [0] * p
        for b, length in enumerate(branches):
            ids += [b + 1] * length
        cu.append(len(ids))
    return torch.tensor(cu, dtype=torch.int32), torch.tensor(ids, dtype=torch.int32)


def _causal64(q, k, v, scale):
    """Plain causal attention of ONE sequence in float64: q [L, Hq, D], k/v [L, Hkv, D]."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = torch.einsum("ihd,jhd->hij", q.double(), k) * scale
    n = q.shape[0]
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), v)


def _unpacked_reference(q, k, v, groups, scale):
    """Each branch scored as its own sequence prefix+branch (the two naive passes); prefix from the first pass."""
    out = torch.empty(q.shape, dtype=torch.float64)
    pos = 0
    for p, branches in groups:
        pre = slice(pos, pos + p)
        start = pos + p
        if not branches:
            out[pre] = _causal64(q[pre], k[pre], v[pre], scale)
        for i, length in enumerate(branches):
            br = torch.arange(start, start + length)
            rows = torch.cat([torch.arange(pos, pos + p), br])
            o = _causal64(q[rows], k[rows], v[rows], scale)
            out[br] = o[p:]
            if i == 0:
                out[pre] = o[:p]
            start += length
        pos = start
    return out


def _qkv(n, hq, hkv, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, h, d, generator=g).to(dtype).to(device) for h in (hq, hkv, hkv)]


LAYOUTS = {
    "dual_context": [(9, [5, 4]), (3, [1, 6]), (12, [7, 8])],
    "odd_sizes": [(5, [3, 1]), (7, []), (0, []), (0, [4, 2]), (20, [17, 19]), (1, [1, 1, 1])],
    "plain_packed": [(6, []), (1, []), (13, []), (6, []), (6, [])],
    "many_branches": [(4, [2, 3, 1, 5, 2]), (2, [2, 2, 2])],
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 8), (3, 3, 12), (4, 1, 16)])
def test_torch_path_equals_unpacked_passes(layout, hq, hkv, d):
    groups = LAYOUTS[layout]
    cu, bids = _pack(groups)
    q, k, v = _qkv(bids.numel(), hq, hkv, d, torch.float32, "cpu", seed=hq * d)
    scale = 1 / math.sqrt(d)
    out = fork_attention(q, k, v, cu, bids, backend="torch")
    assert out.dtype == torch.float32 and out.shape == q.shape
    ref = _unpacked_reference(q, k, v, groups, scale)
    assert_close_scaled(out, ref, rel=REL[torch.float32])
    torch.testing.assert_close(fork_attention_reference(q, k, v, cu, bids), ref, atol=1e-12, rtol=0)  # both float64


def test_torch_path_random_layouts_and_scale():
    rng = random.Random(0)
    for trial in range(20):
        groups = [(rng.randint(0, 12), [rng.randint(1, 9) for _ in range(rng.randint(0, 3))])
                  for _ in range(rng.randint(1, 5))]
        cu, bids = _pack(groups)
        if bids.numel() == 0:
            continue
        q, k, v = _qkv(bids.numel(), 4, 2, 8, torch.float32, "cpu", seed=trial)
        out = fork_attention(q, k, v, cu, bids, backend="torch", softmax_scale=0.2)
        ref = _unpacked_reference(q, k, v, groups, 0.2)
        assert_close_scaled(out, ref, rel=REL[torch.float32], msg=f"trial {trial}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_path_low_precision(dtype):
    groups = LAYOUTS["dual_context"]
    cu, bids = _pack(groups)
    q, k, v = _qkv(bids.numel(), 4, 2, 16, dtype, "cpu", seed=3)
    out = fork_attention(q, k, v, cu, bids, backend="torch")
    assert out.dtype == dtype
    assert_close_scaled(out, _unpacked_reference(q, k, v, groups, 0.25), rel=REL[dtype], msg=str(dtype))


def test_metadata_reuse_and_noncontiguous_inputs():
    groups = LAYOUTS["odd_sizes"]
    cu, bids = _pack(groups)
    meta = build_fork_metadata(cu, bids)
    qkv = torch.randn(bids.numel(), 4, 8)  # fused QKV projection output, sliced: non-contiguous views
    q, k, v = qkv[:, 0:2], qkv[:, 2:3], qkv[:, 3:4]
    out = fork_attention(q, k, v, cu, bids, backend="torch", meta=meta)
    assert_close_scaled(out, _unpacked_reference(q, k, v, groups, 1 / math.sqrt(8)), rel=REL[torch.float32])
    again = fork_attention(q, k, v, None, None, backend="torch", meta=meta)
    assert_close_scaled(again, out, rel=REL[torch.float32], msg="metadata reused")


def test_bad_layouts_are_rejected():
    q = k = v = torch.randn(6, 2, 8)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="prefix"):
        fork_attention(q, k, v, cu, torch.tensor([0, 0, 1, 1, 0, 2], dtype=torch.int32), backend="torch")
    with pytest.raises(ValueError, match="contiguous run"):
        fork_attention(q, k, v, cu, torch.tensor([0, 0, 1, 2, 1, 2], dtype=torch.int32), backend="torch")
    with pytest.raises(ValueError, match="end at N"):
        fork_attention(q, k, v, torch.tensor([0, 5], dtype=torch.int32), torch.zeros(6, dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple"):
        fork_attention(q, torch.randn(6, 3, 8), torch.randn(6, 3, 8), cu, torch.zeros(6, dtype=torch.int32))
    # the same branch id in two different groups is fine (ids are per group)
    two = fork_attention(q, k, v, torch.tensor([0, 3, 6], dtype=torch.int32),
                         torch.tensor([0, 1, 1, 0, 1, 1], dtype=torch.int32), backend="torch")
    assert torch.isfinite(two).all()


# ---------------------------------------------------------------------------------------------- Triton
@pytest.fixture
def small_blocks(monkeypatch):
    import opid_mega.kernels.fork_attention_triton as ft
    if not ON_GPU:
        monkeypatch.setattr(ft, "BLOCK_M", 16)
        monkeypatch.setattr(ft, "BLOCK_N", 16)
    return ft


@pytest.mark.parametrize("layout", ["odd_sizes", "plain_packed", "many_branches"])
def test_triton_equals_unpacked_passes_fp32(layout, small_blocks, device):
    groups = LAYOUTS[layout]
    cu, bids = _pack(groups)
    q, k, v = _qkv(bids.numel(), 4, 2, 12, torch.float32, device, seed=7)
    out = fork_attention(q, k, v, cu.to(device), bids.to(device), backend="triton")
    assert out.dtype == torch.float32 and out.device == q.device
    ref = _unpacked_reference(q.cpu(), k.cpu(), v.cpu(), groups, 1 / math.sqrt(12))
    assert_close_scaled(out, ref, rel=REL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_low_precision(dtype, small_blocks, device):
    groups = LAYOUTS["dual_context"]
    cu, bids = _pack(groups)
    q, k, v = _qkv(bids.numel(), 4, 1, 16, dtype, device, seed=9)
    out = fork_attention(q, k, v, cu.to(device), bids.to(device), backend="triton")
    assert out.dtype == dtype
    ref = _unpacked_reference(q.cpu(), k.cpu(), v.cpu(), groups, 0.25)
    assert_close_scaled(out, ref, rel=REL[dtype], msg=str(dtype))


def test_triton_long_branches_skip_blocks(small_blocks, device):
    """Branches spanning several key blocks, block boundaries inside branches, random layouts."""
    rng = random.Random(1)
    for trial in range(4):
        groups = [(rng.randint(0, 40), [rng.randint(1, 40) for _ in range(rng.randint(0, 3))]) for _ in range(3)]
        cu, bids = _pack(groups)
        q, k, v = _qkv(bids.numel(), 2, 1, 8, torch.float32, device, seed=trial)
        out = fork_attention(q, k, v, cu.to(device), bids.to(device), backend="triton")
        ref = _unpacked_reference(q.cpu(), k.cpu(), v.cpu(), groups, 1 / math.sqrt(8))
        assert_close_scaled(out, ref, rel=REL[torch.float32], msg=f"trial {trial}")
