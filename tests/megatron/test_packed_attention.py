"""Packed layouts as PackedSeqParams (issue 13): varlen training attention = the dense-mask reference (log-probs and
gradients, fp32: within 1e-5 of the largest magnitude compared), activation recompute none = selective = full.
The fork-layout scoring check (fork = two naive passes, both attention paths) is in test_megatron_quick.py."""

import pytest
import torch
import torch.nn.functional as F

from megatron_testutil import make_hf_model, random_sequences
from tolerance import assert_close_scaled, assert_dicts_close_scaled

pytest.importorskip("megatron.core")


def dense_mask_attention(q, k, v, params, *, softmax_scale, dropout_p=0.0, te_module=None, dropout_rng=None):
    """The previous training path: ONE SDPA over the whole pack with the dense [N, N] fork mask."""
    from opid_mega.kernels.fork_attention import fork_attention_mask

    mask = fork_attention_mask(params.cu_seqlens_q, params.branches(q.device))
    rep = q.shape[1] // k.shape[1]
    qq, kk, vv = (x.transpose(0, 1)[None] for x in (q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)))
    return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=softmax_scale)[0].transpose(0, 1)


def _reference_grads(q, k, v, cu, branch_ids, w):
    """float64 dense-mask reference output and d(sum(out * w))/d(q, k, v)."""
    from opid_mega.kernels.fork_attention import fork_attention_reference

    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    out = fork_attention_reference(qd, kd, vd, cu, branch_ids)
    (out * w.double()).sum().backward()
    return out.detach(), (qd.grad, kd.grad, vd.grad)


@pytest.mark.parametrize("branches", [False, True])
def test_varlen_and_group_mask_attention_match_the_float64_reference(branches):
    """Kernel level: varlen (no branches) and per-group masks (branches, grad) = float64 dense reference,
    outputs and gradients; GQA; an empty segment; the attention never builds an N x N mask."""
    from opid_mega.megatron import attention

    g = torch.Generator().manual_seed(0)
    lens = [13, 0, 29, 7, 21]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    n = int(cu[-1])
    br = torch.zeros(n, dtype=torch.int32)
    if branches:  # group 2 (29 tokens): prefix 9, branch 1 of 12, branch 2 of 8
        s = int(cu[2])
        br[s + 9:s + 21] = 1
        br[s + 21:s + 29] = 2
    q, k, v = (torch.randn(n, h, 16, generator=g, requires_grad=True) for h in (4, 2, 2))
    w = torch.randn(n, 4, 16, generator=g)
    params = attention.packed_seq_params(cu, br if branches else None)
    assert params.has_branches == branches and params.max_seqlen_q == 29
    scale = 0.25
    if branches:
        out = attention.segment_attention(q, k, v, cu.tolist(), softmax_scale=scale, masks=params.group_masks("cpu"))
        assert max(m.shape[0] for m in params.group_masks("cpu")) == 29  # one mask per group, never [N, N]
    else:  # the CPU varlen path (one output buffer), and per-sequence SDPA (the generic fallback)
        out = attention.varlen_attention(q, k, v, params, softmax_scale=scale)
        assert attention.varlen_backend(q) == "sdpa" and out.grad_fn.name().endswith("CpuVarlenFlashBackward")
    ref, ref_grads = _reference_grads(q, k, v, cu, br, w)
    runs = [out] if branches else [out, attention.segment_attention(q, k, v, cu.tolist(), softmax_scale=scale)]
    for o in runs:
        for x in (q, k, v):
            x.grad = None
        (o * w).sum().backward()
        assert o.dtype == torch.float32
        assert_close_scaled(o, ref, msg="attention output")  # fp32 vs float64: 1e-5 of the largest entry
        for name, x, gr in zip("qkv", (q, k, v), ref_grads):
            assert_close_scaled(x.grad, gr, msg=f"d{name}")


def _model(hf_dir, recompute="none"):
    from transformers import AutoConfig

    from opid_mega.megatron import weights
    from opid_mega.megatron.model import build_model, recompute_config, transformer_config

    cfg = AutoConfig.from_pretrained(hf_dir)
    chunks = build_model(cfg, transformer_config(cfg, **recompute_config(recompute)))
    weights.load_hf_weights(chunks, cfg, hf_dir)
    return chunks[0]


def _fwd_bwd(model, batch, weights_seed=0):
    """Train-mode forward of the packed batch through ``packed_seq_params``, backward of a random weighting of
    the log-probs; returns (log-probs, {name: grad})."""
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(batch.input_ids, batch.position_ids, None, packed_seq_params=batch.packed_seq_params(),
                score_rows=batch.score_rows, score_targets=batch.score_targets)
    w = torch.randn(out.shape[1], generator=torch.Generator().manual_seed(weights_seed))
    (out[0] * w).sum().backward()
    return out[0].detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_model_varlen_path_equals_dense_mask_reference(mp1, tmp_path, monkeypatch):
    """A packed micro-batch of several sequences: log-probs and every parameter gradient of the varlen path equal
    the dense-mask path (two fp32 paths: within 1e-5 of each tensor's largest entry); the varlen run builds no
    [N, N] mask; a plain megatron PackedSeqParams (thd) gives the same numbers; without packed_seq_params the pack
    would be one sequence (different numbers)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from opid_mega.megatron import attention
    from opid_mega.megatron.logprobs import Sample, plain_batches

    make_hf_model("qwen3", str(tmp_path), layers=2)
    model = _model(str(tmp_path))
    seqs = random_sequences(11, [(37, 1), (64, 5), (5, 2), (90, 30), (23, 1)])
    (batch,) = plain_batches([Sample(t, k) for t, k in seqs], 219).batches

    def no_dense_mask(*a, **k):
        raise AssertionError("the varlen path built a dense mask")

    with monkeypatch.context() as m:
        m.setattr(attention, "fork_attention_mask", no_dense_mask)
        lp, grads = _fwd_bwd(model, batch)
    with monkeypatch.context() as m:
        m.setattr(attention, "varlen_attention", dense_mask_attention)
        lp_ref, grads_ref = _fwd_bwd(model, batch)
    assert lp.numel() == sum(len(t) - k for t, k in seqs)
    assert_close_scaled(lp, lp_ref, msg="log-probs")
    assert_dicts_close_scaled(grads, grads_ref, msg="grad")

    plain = PackedSeqParams(qkv_format="thd", cu_seqlens_q=batch.cu_seqlens, cu_seqlens_kv=batch.cu_seqlens,
                            max_seqlen_q=90, max_seqlen_kv=90)
    model.eval()
    with torch.no_grad():
        out = model(batch.input_ids, batch.position_ids, None, packed_seq_params=plain, score_rows=batch.score_rows,
                    score_targets=batch.score_targets)
        one_seq = model(batch.input_ids, batch.position_ids, None, score_rows=batch.score_rows,
                        score_targets=batch.score_targets)
    assert_close_scaled(out[0], lp, msg="plain thd PackedSeqParams")
    assert (one_seq[0] - lp).abs().max() > 1e-3
    with pytest.raises(ValueError, match="covers 219 tokens"):
        model(batch.input_ids[:, :-1], batch.position_ids[:, :-1], None, packed_seq_params=plain,
              score_rows=batch.score_rows[:1], score_targets=batch.score_targets[:1])


def _fork_batch(seed=3):
    """A fork-layout batch: a shared prefix and two branches with their own positions (as in the quick test)."""
    from opid_mega.megatron.logprobs import PackedBatch

    g = torch.Generator().manual_seed(seed)
    P, S, T, R = 7, 4, 3, 5
    prefix, skill, tail, resp = (torch.randint(0, 1024, (n,), generator=g).tolist() for n in (P, S, T, R))
    ids = prefix + skill + tail + resp + tail + resp
    pos = list(range(P)) + list(range(P, P + S + T + R)) + list(range(P, P + T + R))
    br = [0] * P + [1] * (S + T + R) + [2] * (T + R)
    rows = [j - 1 for j in range(P + S + T, P + S + T + R)] + [j - 1 for j in range(len(ids) - R, len(ids))]
    return PackedBatch(torch.tensor([ids]), torch.tensor([pos]), torch.tensor([0, len(ids)], dtype=torch.int32),
                       torch.tensor(rows), torch.tensor(resp + resp), [R, R],
                       branch_ids=torch.tensor(br, dtype=torch.int32))


def test_recompute_none_selective_full_give_equal_gradients(mp1, tmp_path, monkeypatch):
    """train.recompute: the recomputed core attention (selective) and layers (full) see the same packed layout in the
    backward (it travels as packed_seq_params), so log-probs and gradients equal recompute=none, for a packed batch
    (varlen path) and a fork-layout batch (per-group masks); the recompute really re-runs the attention."""
    from opid_mega.megatron import attention
    from opid_mega.megatron.logprobs import Sample, plain_batches
    from opid_mega.megatron.model import recompute_config

    make_hf_model("qwen2", str(tmp_path), layers=2)
    plain = plain_batches([Sample(t, k) for t, k in random_sequences(12, [(31, 2), (48, 9), (17, 1)])], 96).batches
    assert len(plain) == 1
    batches = [plain[0], _fork_batch()]
    calls = {"n": 0}
    forward = attention.PackedCoreAttention.forward

    def counting(self, *a, **k):
        calls["n"] += 1
        return forward(self, *a, **k)

    monkeypatch.setattr(attention.PackedCoreAttention, "forward", counting)
    results = {}
    for mode in ("none", "selective", "full"):
        model = _model(str(tmp_path), mode)
        assert model.config.recompute_granularity == (None if mode == "none" else mode)
        calls["n"] = 0
        results[mode] = [_fwd_bwd(model, b, weights_seed=i) for i, b in enumerate(batches)]
        assert calls["n"] == (2 if mode == "none" else 4) * len(batches)  # 2 layers; recompute: once more
    for mode in ("selective", "full"):
        for (lp, grads), (lp0, grads0) in zip(results[mode], results["none"]):
            assert_close_scaled(lp, lp0, msg=f"{mode} log-probs")
            assert_dicts_close_scaled(grads, grads0, msg=f"{mode} grad")
    with pytest.raises(ValueError, match="recompute='some'"):
        recompute_config("some")


def test_train_recompute_config_key_reaches_the_policy_model(mp1, tmp_path):
    from opid_mega.config import ConfigError, load_config
    from opid_mega.megatron.policy import Policy

    assert load_config(None).train.recompute == "none"
    with pytest.raises(ConfigError, match="train.recompute"):
        load_config(None, ["train.recompute=partial"])
    make_hf_model("llama", str(tmp_path), layers=2)
    policy = Policy(load_config(None, ["train.recompute=full"]), str(tmp_path))
    c = policy.chunks[0].config
    assert (c.recompute_granularity, c.recompute_method, c.recompute_num_layers) == ("full", "uniform", 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the TE / flash-attn varlen kernels need a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_varlen_kernels_match_the_reference(mp1, dtype):
    """On GPU, PackedCoreAttention in training picks Transformer Engine (THD) or flash-attn varlen for bf16 (per-
    sequence SDPA for fp32); outputs and gradients match the float64 dense reference (bf16: 3e-2, fp32: 1e-5)."""
    import torch.nn.functional as Fn
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from opid_mega.megatron import attention

    cfg = TransformerConfig(num_layers=1, hidden_size=256, num_attention_heads=8, num_query_groups=2, kv_channels=64,
                            attention_dropout=0.0, hidden_dropout=0.0, params_dtype=dtype, bf16=dtype == torch.bfloat16,
                            apply_rope_fusion=False, activation_func=Fn.silu)
    core = attention.PackedCoreAttention(cfg, 1, AttnMaskType.causal, "self").cuda().train()
    lens = [300, 17, 0, 513, 128]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    n = int(cu[-1])
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(n, h, 64, device="cuda", generator=g).to(dtype).requires_grad_() for h in (8, 2, 2))
    w = torch.randn(n, 8, 64, device="cuda", generator=g)
    params = attention.packed_seq_params(cu, device="cuda")
    out = core(q, k, v, None, packed_seq_params=params)
    assert out.shape == (n, 1, 8 * 64)
    (out.float().reshape(n, 8, 64) * w).sum().backward()
    want = "sdpa" if dtype == torch.float32 else attention.varlen_backend(q)
    assert attention.varlen_backend(q) == want
    ref, ref_grads = _reference_grads(q.float(), k.float(), v.float(), cu.cuda(), torch.zeros(n, dtype=torch.int32,
                                                                                            device="cuda"), w)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    # relative to the largest entry, never below the former absolute tol (floor 1: not verified on a GPU here)
    assert_close_scaled(out.reshape(n, 8, 64), ref, rel=tol, floor=1.0, msg=f"{dtype} output")
    for name, x, gr in zip("qkv", (q, k, v), ref_grads):
        assert_close_scaled(x.grad, gr, rel=tol, floor=1.0, msg=f"{dtype} d{name}")
