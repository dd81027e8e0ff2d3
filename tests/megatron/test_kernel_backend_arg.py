"""The kernel backend (a run's ``scoring.kernel_backend``) reaches ``opid_mega.kernels`` as an argument: build_model /
build_chunk -> OpidGPTModel (log-prob head, divergence) and, through the layer spec's ``ModuleSpec.params``, every
layer's PackedCoreAttention (fork attention). No environment variable is involved.

Proof that the argument arrives: on the CPU without ``TRITON_INTERPRET``, backend="triton" is an error of
``opid_mega.kernels._dispatch.resolve_backend`` naming the kernel and TRITON_INTERPRET -- a model built with
kernel_backend="triton" raises it from each kernel it calls, while kernel_backend="torch" scores."""
import pytest
import torch

pytest.importorskip("megatron.core")

ARCH = dict(hidden=32, ffn=64, layers=2, heads=4, kv_heads=2, head_dim=8, vocab=128, eps=1e-6, rope_theta=10000.0,
            qkv_bias=False, qk_norm=False, tied=True, max_pos=64)


@pytest.fixture(autouse=True)
def _no_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # backend="triton" on a CPU tensor must then be refused
    monkeypatch.delenv("OPID_TRITON_INTERPRET", raising=False)


def _triton_refused(kernel: str) -> str:
    """The message pattern of resolve_backend's refusal of backend='triton' on a CPU tensor for ``kernel``."""
    from opid_mega.kernels._dispatch import triton_available

    return rf"{kernel}: backend='triton' " + (r".*TRITON_INTERPRET" if triton_available() else r".*cannot be imported")


def _build(kernel_backend=None, seed=0):
    from opid_mega.megatron.model import build_model, transformer_config

    torch.manual_seed(seed)
    cfg = transformer_config(ARCH)
    if kernel_backend is None:  # an existing call site: the default
        return build_model(ARCH, cfg)
    return build_model(ARCH, cfg, kernel_backend=kernel_backend)


def _batch():
    from opid_mega.megatron.attention import packed_seq_params

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, ARCH["vocab"], (1, 14), generator=g)
    pos = torch.tensor([list(range(4)) + list(range(4, 9)) + list(range(4, 9))])  # a prefix and two branches
    params = packed_seq_params(torch.tensor([0, 14]), torch.tensor([0] * 4 + [1] * 5 + [2] * 5))
    rows = torch.tensor([4, 5, 6, 7, 9, 10, 11, 12])
    targets = ids[0, rows + 1]
    pairs = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])  # branch 1's rows paired with branch 2's
    targets[4:] = targets[:4]  # a pair scores the same target token
    return ids, pos, params, rows, targets, pairs


def _cores(chunks):
    from opid_mega.megatron.attention import PackedCoreAttention

    cores = [m for c in chunks for m in c.modules() if isinstance(m, PackedCoreAttention)]
    assert len(cores) == ARCH["layers"]
    return cores


@pytest.mark.parametrize("backend", ["auto", "triton", "torch"])
def test_built_modules_carry_the_kernel_backend(mp1, backend):
    from opid_mega.megatron.model import layer_spec, transformer_config

    chunks = _build(backend)
    assert chunks[0].kernel_backend == backend
    assert chunks[0].decoder.layers[0].self_attention.core_attention.kernel_backend == backend
    assert all(c.kernel_backend == backend for c in _cores(chunks))
    core_spec = layer_spec(transformer_config(ARCH), kernel_backend=backend).submodules.self_attention.submodules
    assert core_spec.core_attention.params == {"kernel_backend": backend}


def test_default_is_auto(mp1):
    chunks = _build()
    assert chunks[0].kernel_backend == "auto" and all(c.kernel_backend == "auto" for c in _cores(chunks))


def test_triton_argument_reaches_every_kernel_and_torch_scores(mp1):
    ids, pos, params, rows, targets, pairs = _batch()
    torch_model = _build("torch")[0]
    triton_model = _build("triton")[0]
    triton_model.load_state_dict(torch_model.state_dict())

    # scoring (eval, no grad): the layers' fork attention is the first kernel called
    triton_model.eval()
    with torch.no_grad(), pytest.raises(RuntimeError, match=_triton_refused("fork_attention")):
        triton_model(ids, pos, None, packed_seq_params=params, score_rows=rows, score_targets=targets)
    # training (varlen attention, no kernel of opid_mega.kernels): the log-prob head's fused_logprobs
    triton_model.train()
    with pytest.raises(RuntimeError, match=_triton_refused("fused_logprobs")):
        triton_model(ids, pos, None, packed_seq_params=params, score_rows=rows, score_targets=targets)
    # the divergence head
    h = torch.randn(rows.numel(), ARCH["hidden"])
    with pytest.raises(RuntimeError, match=_triton_refused("dual_context_divergence")):
        triton_model._divergence(h, targets, pairs, 1.0, 0)

    torch_model.eval()
    with torch.no_grad():
        scored = torch_model(ids, pos, None, packed_seq_params=params, score_rows=rows, score_targets=targets,
                             return_entropy=True)
    assert scored.shape == (2, rows.numel()) and torch.isfinite(scored).all() and bool((scored[0] <= 0).all())
    torch_model.train()
    lp, div = torch_model(ids, pos, None, packed_seq_params=params, score_rows=rows, score_targets=targets,
                          pairs=pairs)
    assert lp.shape == (1, rows.numel()) and torch.isfinite(lp).all()
    assert all(torch.isfinite(v).all() for v in div.values() if isinstance(v, torch.Tensor))
    (lp.sum() + sum(v.sum() for v in div.values() if isinstance(v, torch.Tensor) and v.requires_grad)).backward()


def test_bad_kernel_backend_is_a_value_error(mp1):
    from megatron.core.transformer.enums import AttnMaskType

    from opid_mega.megatron.attention import PackedCoreAttention
    from opid_mega.megatron.model import build_chunk, layer_spec, transformer_config

    cfg = transformer_config(ARCH)
    with pytest.raises(ValueError, match=r"kernel_backend must be one of \('auto', 'triton', 'torch'\), got 'cuda'"):
        PackedCoreAttention(cfg, 1, AttnMaskType.causal, "self", kernel_backend="cuda")
    with pytest.raises(ValueError, match="kernel_backend must be one of"):
        layer_spec(cfg, kernel_backend="Torch")
    with pytest.raises(ValueError, match="kernel_backend must be one of"):
        build_chunk(ARCH, cfg, kernel_backend="")
