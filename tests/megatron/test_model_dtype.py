"""model.dtype -> every parameter and floating buffer of the built model, norms included (megatron's Float16Module
semantics, opid_mega.megatron.model.to_model_dtype), on the CPU path and on the GPU path of build_chunk (run here
with torch.cuda pretended present and Module.cuda a no-op: megatron then builds linear weights in params_dtype and
torch norms in fp32, which the GPU path used to keep); the last stage's log-probs are fp32."""
import pytest
import torch

pytest.importorskip("megatron.core")

ARCH = dict(hidden=32, ffn=64, layers=2, heads=4, kv_heads=2, head_dim=8, vocab=128, eps=1e-6, rope_theta=10000.0,
            qkv_bias=True, qk_norm=True, tied=False, max_pos=64)


def _floating(m):
    return [(n, t.dtype) for n, t in list(m.named_parameters()) + list(m.named_buffers()) if t.is_floating_point()]


@pytest.mark.parametrize("gpu_path", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_parameter_follows_the_model_dtype(mp1, monkeypatch, dtype, gpu_path):
    from opid_mega.megatron import attention
    from opid_mega.megatron.model import build_model, model_dtype, transformer_config

    cfg = transformer_config(ARCH, dtype=dtype)
    assert model_dtype(cfg) == dtype
    moved = []
    if gpu_path:
        with monkeypatch.context() as m:
            m.setattr(torch.cuda, "is_available", lambda: True)
            m.setattr(torch.nn.Module, "cuda", lambda self, device=None: moved.append(1) or self)
            model = build_model(ARCH, cfg)[0]
        assert moved  # the GPU branch ran
    else:
        model = build_model(ARCH, cfg)[0]
    got = _floating(model)
    norms = [n for n, _ in got if "norm" in n]
    assert len(norms) >= 2 * ARCH["layers"] + 1  # input/pre-MLP (fused or not), q/k norms, the final norm
    wrong = [(n, d) for n, d in got if d != dtype]
    assert not wrong, f"not {dtype}: {wrong[:6]}"

    ids = torch.randint(0, 128, (1, 14), generator=torch.Generator().manual_seed(0))
    params = attention.packed_seq_params(torch.tensor([0, 6, 14]))
    model.train()
    out = model(ids, torch.cat([torch.arange(6), torch.arange(8)])[None], None, packed_seq_params=params,
                score_rows=torch.arange(13), score_targets=ids[0, 1:], return_entropy=True)
    assert out.dtype == torch.float32 and out.shape == (2, 13) and torch.isfinite(out).all()
    out[0].sum().backward()
    assert all(p.grad is not None and p.grad.dtype == dtype for p in model.parameters())
    model.eval()
    with torch.no_grad():
        hidden = model(ids, torch.arange(14)[None], None)  # no rows: the final hidden states, fp32 as well
    assert hidden.dtype == torch.float32
