"""Transformer Engine's ``_extra_state`` across machines (opid_mega.megatron.extra_state): a checkpoint written by a
model whose core attention carries TE's DotProductAttention loads strictly into the CPU (local-spec) model and back;
the key is megatron's TE GPTModel's (``...core_attention._extra_state``); checkpoints with the older key
(``...core_attention.te_attention._extra_state``) or none at all load too. TE does not run on a CPU: the TE child is a
stand-in that keeps what TE keeps in a state dict (a uint8 tensor of a serialised dict, TE 2.x)."""
import dataclasses
import io

import pytest
import torch

pytest.importorskip("megatron.core")

ARCH = dict(hidden=32, ffn=64, layers=2, heads=4, kv_heads=2, head_dim=8, vocab=128, eps=1e-6, rope_theta=10000.0,
            qkv_bias=False, qk_norm=True, tied=False, max_pos=64)
NOW, BEFORE = "core_attention._extra_state", "core_attention.te_attention._extra_state"


@pytest.fixture(scope="module")
def mp1():
    from opid_mega.megatron import parallel

    parallel.initialize(1, 1)
    yield
    parallel.destroy_all()


class StandInTEAttention(torch.nn.Module):
    """The state-dict face of TE's DotProductAttention: get/set_extra_state with a serialised fp8-meta dict."""

    def __init__(self, payload):
        super().__init__()
        self.payload, self.loaded = payload, []

    def get_extra_state(self):
        buf = io.BytesIO()
        torch.save(self.payload, buf)
        return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)

    def set_extra_state(self, state):
        self.loaded.append(None if state is None else torch.load(io.BytesIO(state.numpy().tobytes())))


def _model(seed, te_payload=None):
    from opid_mega.megatron.attention import PackedCoreAttention
    from opid_mega.megatron.model import build_model, transformer_config

    torch.manual_seed(seed)
    m = build_model(ARCH, transformer_config(ARCH))[0]
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    cores = [c for c in m.modules() if isinstance(c, PackedCoreAttention)]
    assert len(cores) == ARCH["layers"]
    if te_payload is not None:
        for i, c in enumerate(cores):
            c.te_attention = StandInTEAttention({"scale_fwd": torch.tensor([float(i + 1)]), **te_payload})
    return m, cores


def _weights(m):
    return {k: v for k, v in m.state_dict().items() if not k.endswith("_extra_state")}


def _assert_same_weights(a, b):
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def test_keys_are_the_same_with_and_without_te(mp1):
    cpu, _ = _model(0)
    te, _ = _model(0, {"recipe": "delayed"})
    assert cpu.state_dict().keys() == te.state_dict().keys()
    assert not [k for k in te.state_dict() if "te_attention" in k]
    assert cpu.state_dict()[f"decoder.layers.0.self_attention.{NOW}"] is None
    assert te.state_dict()[f"decoder.layers.0.self_attention.{NOW}"].dtype == torch.uint8
    keys = {v.key for v in te.sharded_state_dict(prefix="").values()}
    assert f"decoder.layers.self_attention.{NOW}" in keys  # the key megatron's TE GPTModel writes
    assert not [k for k in keys if "te_attention" in k]


def test_te_checkpoint_loads_strictly_into_the_local_model_and_back(mp1, tmp_path):
    from opid_mega.megatron import checkpoint

    te, _ = _model(1, {"recipe": "delayed"})
    cpu, _ = _model(2)
    checkpoint.save(str(tmp_path / "te"), 1, [te])
    checkpoint.load(str(tmp_path / "te"), [cpu])  # strict load_state_dict
    _assert_same_weights(te, cpu)

    checkpoint.save(str(tmp_path / "cpu"), 1, [cpu])
    te2, cores = _model(3, {"recipe": "delayed"})
    checkpoint.load(str(tmp_path / "cpu"), [te2])
    _assert_same_weights(cpu, te2)
    assert [c.te_attention.loaded for c in cores] == [[None], [None]]  # TE ignores None

    te3, cores = _model(4, {"recipe": "x"})  # TE -> TE: the fp8 metadata comes back per layer
    checkpoint.load(str(tmp_path / "te"), [te3])
    got = [c.te_attention.loaded[0] for c in cores]
    assert [g["recipe"] for g in got] == ["delayed", "delayed"]
    assert [float(g["scale_fwd"]) for g in got] == [1.0, 2.0]


def _save_with(model, path, rename):
    """A distributed checkpoint of ``model`` with its core-attention extra state renamed (``rename`` -> new key
    suffix) or left out (None), as an older TE model / a local-spec GPTModel wrote it."""
    from megatron.core import dist_checkpointing

    sd = model.sharded_state_dict(prefix="")
    for k in [k for k in sd if k.endswith(NOW)]:
        obj = sd.pop(k)
        if rename is not None:
            sd[k[:-len(NOW)] + rename] = dataclasses.replace(obj, key=obj.key[:-len(NOW)] + rename)
    path.mkdir()
    dist_checkpointing.save({"model": sd}, str(path))


@pytest.mark.parametrize("layout", ["older_te_key", "no_key"])
def test_checkpoints_with_the_older_key_or_none_load(mp1, tmp_path, layout):
    from opid_mega.megatron import checkpoint

    te, _ = _model(5, {"recipe": "delayed"})
    _save_with(te, tmp_path / "ckpt", BEFORE if layout == "older_te_key" else None)
    cpu, _ = _model(6)
    checkpoint.load_model(str(tmp_path / "ckpt"), [cpu])
    _assert_same_weights(te, cpu)
    te2, cores = _model(7, {"recipe": "x"})
    checkpoint.load_model(str(tmp_path / "ckpt"), [te2])
    _assert_same_weights(te, te2)
    loaded = [c.te_attention.loaded for c in cores]
    if layout == "older_te_key":
        assert [lst[0]["recipe"] for lst in loaded] == ["delayed", "delayed"]
    else:
        assert loaded == [[None], [None]]


def test_torch_state_dicts_map_both_ways(mp1):
    """Plain torch state dicts (no megatron checkpointing): one with the older TE key loads strictly into the local
    model and into a TE model (which receives it); the local model's (None) loads strictly into a TE model."""
    te, _ = _model(8, {"recipe": "delayed"})
    old = {(k[:-len(NOW)] + BEFORE if k.endswith(NOW) else k): v for k, v in te.state_dict().items()}
    cpu, _ = _model(9)
    cpu.load_state_dict(old)
    _assert_same_weights(te, cpu)
    te2, cores = _model(10, {"recipe": "x"})
    te2.load_state_dict(old)
    assert [c.te_attention.loaded[0]["recipe"] for c in cores] == ["delayed", "delayed"]
    te3, cores = _model(11, {"recipe": "x"})
    te3.load_state_dict(cpu.state_dict())
    assert [c.te_attention.loaded for c in cores] == [[None], [None]]
    _assert_same_weights(cpu, te3)
