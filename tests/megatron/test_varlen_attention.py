"""Training attention as ONE varlen call (opid_mega.megatron.attention.VarlenLayout, issue 24): plain packs and
fork-layout (distillation) batches -- values and gradients against the float64 dense-mask reference at kernel level,
and through the model against the dense-mask path (log-probs and every parameter gradient), with no [N, N] or
per-group mask built. The GPU kernel (torch.nn.attention.varlen.varlen_attn) cannot run on a CPU: its call is
checked here against a stand-in that implements the documented semantics (cu_seq_q / cu_seq_k, causal aligned
bottom-right, GQA), on a GPU against the reference itself.

Tolerances: two fp32 paths, or fp32 against float64, within 1e-5 of the largest magnitude compared (+ a few ulps)."""
import pytest
import torch
import torch.nn.functional as F

from megatron_testutil import make_hf_model, random_sequences

pytest.importorskip("megatron.core")


def _close(got, ref, rel=1e-5, what=""):
    ref = ref.double()
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    err = float((got.double() - ref).abs().max()) if ref.numel() else 0.0
    assert err <= (rel + 4 * 1.19e-7) * max(scale, 1e-30), f"{what}: max error {err:.3g} vs scale {scale:.3g}"


def _fork_layout(spec, seed=0):
    """cu_seqlens and branch ids of groups ``spec`` = [(prefix length, [branch lengths])]."""
    cu, br = [0], []
    for prefix, branches in spec:
        br += [0] * prefix
        for b, n in enumerate(branches):
            br += [b + 1] * n
        cu.append(len(br))
    return torch.tensor(cu, dtype=torch.int32), torch.tensor(br, dtype=torch.int32)


LAYOUTS = {
    "plain": [(13, []), (0, []), (29, []), (7, []), (21, [])],
    "fork": [(7, [12, 8]), (9, []), (0, [5, 6]), (11, [3, 1, 9]), (0, []), (4, [10])],
}


def _reference(q, k, v, cu, br, w, scale):
    from opid_mega.kernels.fork_attention import fork_attention_reference

    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    out = fork_attention_reference(qd, kd, vd, cu, br, softmax_scale=scale)
    (out * w.double()).sum().backward()
    return out.detach(), (qd.grad, kd.grad, vd.grad)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_varlen_layout_equals_the_float64_fork_reference(layout):
    """Kernel level, fp32 on the CPU: the layout's segments through SDPA's CPU flash kernels (the CPU training path)
    and through per-segment SDPA (the fallback) = the float64 dense fork reference, outputs and q/k/v gradients;
    GQA; empty groups; groups without a prefix; the keys of a branch are its prefix and itself only."""
    from opid_mega.megatron import attention

    cu, br = _fork_layout(LAYOUTS[layout])
    n = int(cu[-1])
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n, h, 16, generator=g, requires_grad=True) for h in (4, 2, 2))
    w = torch.randn(n, 4, 16, generator=g)
    params = attention.packed_seq_params(cu, br if layout == "fork" else None)
    lay = params.varlen_layout("cpu")
    if layout == "fork":
        # group 0: prefix [0, 7) alone, branch 1 [7, 19) with keys [0, 7) + [7, 19), branch 2 [19, 27) with [0, 7) +
        # [19, 27); keys never cross into another branch
        assert lay.segments()[:3] == [(0, 7, 0, 7), (7, 19, 7, 26), (19, 27, 26, 41)]
        assert lay.kv_index[7:26].tolist() == list(range(19)) and lay.kv_index[26:41].tolist() == \
            list(range(7)) + list(range(19, 27))
        assert lay.max_k == 11 + 9 and lay.num_segments == 1 + 2 + 1 + 2 + 4 + 2
    else:
        assert lay.kv_index is None and lay.q_bounds == [0, 13, 42, 49, 70]
    ref, ref_grads = _reference(q, k, v, cu, br, w, 0.25)
    for name, run in (("cpu flash", lambda: attention.varlen_attention(q, k, v, params, softmax_scale=0.25)),
                      ("per segment", lambda: attention.segment_varlen_attention(q, k, v, lay, softmax_scale=0.25))):
        for x in (q, k, v):
            x.grad = None
        out = run()
        if name == "cpu flash":
            assert out.grad_fn.name().endswith("CpuVarlenFlashBackward")
        (out * w).sum().backward()
        _close(out, ref, what=f"{layout} {name} output")
        for xn, x, gr in zip("qkv", (q, k, v), ref_grads):
            _close(x.grad, gr, what=f"{layout} {name} d{xn}")


def test_bad_fork_layouts_are_refused():
    from opid_mega.megatron import attention

    cu = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="branch id 0 after a branch"):
        attention.packed_seq_params(cu, torch.tensor([0, 1, 1, 0, 2, 2], dtype=torch.int32)).varlen_layout("cpu")
    with pytest.raises(ValueError, match="branch 1 of group 0 is not contiguous"):
        attention.packed_seq_params(cu, torch.tensor([0, 1, 2, 2, 1, 1], dtype=torch.int32)).varlen_layout("cpu")


# ------------------------------------------------------------------------------------------------- through the model
# the dense-mask reference is test_packed_attention's (one definition); `mp1` comes from conftest.py
from test_packed_attention import dense_mask_attention  # noqa: E402,F401


def _model(hf_dir):
    from transformers import AutoConfig

    from opid_mega.megatron import weights
    from opid_mega.megatron.model import build_model, transformer_config

    cfg = AutoConfig.from_pretrained(hf_dir)
    chunks = build_model(cfg, transformer_config(cfg))
    weights.load_hf_weights(chunks, cfg, hf_dir)
    return chunks[0]


def _fork_batch(seed=3):
    """A distillation-style fork-layout micro-batch: groups of a shared prefix and branches (skill context + response
    and the original response, each with its own positions), a plain sequence, a group without a prefix."""
    from opid_mega.megatron.logprobs import PackedBatch

    g = torch.Generator().manual_seed(seed)
    ids, pos, br, cu, rows, targets = [], [], [], [0], [], []
    for prefix, branches in [(9, [14, 9]), (11, []), (6, [5, 12, 7]), (0, [8, 6])]:
        start = len(ids)
        ids += torch.randint(0, 1024, (prefix,), generator=g).tolist()
        pos += list(range(prefix))
        br += [0] * prefix
        for b, n in enumerate(branches):
            toks = torch.randint(0, 1024, (n,), generator=g).tolist()
            first = len(ids)
            ids += toks
            pos += list(range(prefix, prefix + n))
            br += [b + 1] * n
            rows += list(range(first, first + n - 1))  # next-token rows inside the branch
            targets += toks[1:]
        if not branches:
            rows += list(range(start, start + prefix - 1))
            targets += ids[start + 1:start + prefix]
        cu.append(len(ids))
    return PackedBatch(torch.tensor([ids]), torch.tensor([pos]), torch.tensor(cu, dtype=torch.int32),
                       torch.tensor(rows), torch.tensor(targets), [len(rows)],
                       branch_ids=torch.tensor(br, dtype=torch.int32))


def _fwd_bwd(model, batch):
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(batch.input_ids, batch.position_ids, None, packed_seq_params=batch.packed_seq_params(),
                score_rows=batch.score_rows, score_targets=batch.score_targets)
    w = torch.randn(out.shape[1], generator=torch.Generator().manual_seed(0))
    (out[0] * w).sum().backward()
    return out[0].detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _compare(lp, grads, lp_ref, grads_ref):
    _close(lp, lp_ref, what="log-probs")
    assert grads.keys() == grads_ref.keys()
    scale = max(float(g.abs().max()) for g in grads_ref.values())  # one scale for one backward pass
    for name in grads:
        err = float((grads[name] - grads_ref[name]).abs().max())
        assert err <= (1e-5 + 4 * 1.19e-7) * scale, f"grad {name}: {err:.3g} vs {scale:.3g}"


def test_model_fork_layout_varlen_equals_the_dense_mask(mp1, tmp_path, monkeypatch):
    """A fork-layout training micro-batch through the model: the varlen path's log-probs and every parameter
    gradient equal the dense-mask path; neither a [N, N] nor a per-group mask is built on the way."""
    from opid_mega.megatron import attention

    make_hf_model("qwen3", str(tmp_path), layers=2)
    model = _model(str(tmp_path))
    batch = _fork_batch()
    assert batch.packed_seq_params().has_branches

    def no_mask(*a, **k):
        raise AssertionError("the varlen path built a dense mask")

    with monkeypatch.context() as m:
        m.setattr(attention, "fork_attention_mask", no_mask)
        m.setattr(attention.ForkPackedSeqParams, "group_masks", no_mask)
        lp, grads = _fwd_bwd(model, batch)
    with monkeypatch.context() as m:
        m.setattr(attention, "varlen_attention", dense_mask_attention)
        lp_ref, grads_ref = _fwd_bwd(model, batch)
    assert lp.numel() == batch.score_rows.numel()
    _compare(lp, grads, lp_ref, grads_ref)


def _stand_in_varlen_attn(calls, *, window=True):
    """torch.nn.attention.varlen.varlen_attn as its source documents it (per cu_seq segment, causal aligned to the
    bottom right as flash attention does for Lq != Lk, fewer KV heads shared by groups of query heads), in float64
    SDPA with an explicit mask; records every call's arguments."""
    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                    is_causal=False, enable_gqa=False):
        assert cu_seq_q.dtype == cu_seq_k.dtype == torch.int32 and cu_seq_q.device == query.device
        calls.append(dict(window_size=window_size, is_causal=is_causal, enable_gqa=enable_gqa, max_q=max_q,
                          max_k=max_k, keys=key.shape[0]))
        causal = window_size == (-1, 0) if window else is_causal
        assert causal, "called without the causal mask"
        assert query.shape[1] == key.shape[1] or enable_gqa or not window  # newer torch wants GQA said
        qb, kb = cu_seq_q.tolist(), cu_seq_k.tolist()
        assert max_q == max(b - a for a, b in zip(qb, qb[1:])) and max_k == max(b - a for a, b in zip(kb, kb[1:]))
        outs = []
        for a, b, c, d in zip(qb, qb[1:], kb, kb[1:]):
            lq, lk = b - a, d - c
            keep = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
            qs, ks, vs = (x.double().transpose(0, 1)[None] for x in (query[a:b], key[c:d], value[c:d]))
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=keep, scale=scale,
                                               enable_gqa=query.shape[1] != key.shape[1])
            outs.append(o[0].transpose(0, 1).to(query.dtype))
        return torch.cat(outs)

    if window:
        return varlen_attn

    def torch_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False):  # no scale, no window
        return varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=is_causal)

    return torch_2_10


@pytest.mark.parametrize("api", ["torch_2_11", "torch_2_10"])
def test_model_through_the_torch_varlen_call(mp1, tmp_path, monkeypatch, api):
    """The GPU call (torch's varlen_attn) as the model makes it, on a fork-layout and a plain batch: with a
    stand-in of the documented semantics the log-probs and gradients equal the dense-mask path. Both signatures:
    window_size=(-1, 0) + scale + enable_gqa (torch >= 2.11) and is_causal only (torch 2.10: the scale goes into q)."""
    import inspect

    from opid_mega.megatron import attention
    from opid_mega.megatron.logprobs import Sample, plain_batches

    calls = []
    fn = _stand_in_varlen_attn(calls, window=api == "torch_2_11")
    params = inspect.signature(fn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    monkeypatch.setattr(attention, "_torch_varlen", lambda: (fn, causal, "scale" in params, "enable_gqa" in params))
    make_hf_model("qwen2", str(tmp_path), layers=2)
    model = _model(str(tmp_path))
    (plain,) = plain_batches([Sample(t, k) for t, k in random_sequences(4, [(31, 2), (48, 9), (17, 1)])], 96).batches
    for batch in (_fork_batch(5), plain):
        with monkeypatch.context() as m:
            m.setattr(attention, "varlen_backend", lambda q, branches=False, dropout_p=0.0: "torch_varlen")
            calls.clear()
            lp, grads = _fwd_bwd(model, batch)
            assert len(calls) == 2  # one call per layer
            lay = batch.packed_seq_params().varlen_layout("cpu")
            assert calls[0]["keys"] == lay.k_bounds[-1] and calls[0]["max_k"] == lay.max_k
            assert (lay.kv_index is not None) == bool(batch.branch_ids is not None)  # fork: gathered keys
            if api == "torch_2_11":
                assert calls[0]["window_size"] == (-1, 0) and calls[0]["enable_gqa"]
        with monkeypatch.context() as m:
            m.setattr(attention, "varlen_attention", dense_mask_attention)
            lp_ref, grads_ref = _fwd_bwd(model, batch)
        _compare(lp, grads, lp_ref, grads_ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's varlen_attn (flash) needs a CUDA GPU")
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_gpu_torch_varlen_attn_matches_the_reference(layout):
    """On a GPU without TE / flash-attn: the training attention in bf16 picks torch's varlen_attn for plain packs
    and fork layouts; outputs and q/k/v gradients match the float64 dense reference (bf16: 2e-2 of the largest)."""
    from opid_mega.megatron import attention

    if attention._torch_varlen() is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    spec = [(p * 9, [b * 9 for b in br]) for p, br in LAYOUTS[layout]]  # longer segments
    cu, br = _fork_layout(spec)
    n = int(cu[-1])
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(n, h, 64, device="cuda", generator=g).bfloat16().requires_grad_() for h in (8, 2, 2))
    w = torch.randn(n, 8, 64, device="cuda", generator=g)
    params = attention.packed_seq_params(cu, br.cuda() if layout == "fork" else None, device="cuda")
    backend = attention.varlen_backend(q, params.has_branches)
    if backend != "torch_varlen":
        pytest.skip(f"this machine uses {backend} first")
    out = attention.varlen_attention(q, k, v, params, softmax_scale=0.125)
    (out.float() * w).sum().backward()
    ref, ref_grads = _reference(q.float(), k.float(), v.float(), cu.cuda(), br.cuda(), w, 0.125)
    _close(out, ref, rel=2e-2, what="output")
    for name, x, gr in zip("qkv", (q, k, v), ref_grads):
        _close(x.grad, gr, rel=2e-2, what=f"d{name}")
